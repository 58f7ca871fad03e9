"""Where a staged push's time went, bucket by bucket: the sender's and a receiver's stamps.

Both sides stamp with ``time.perf_counter()``, one monotonic clock for every process of a Linux
machine, so a bucket's chain can be followed across the two processes:

    sender   waited -> free -> loads_done -> queued -> copied -> signalled
    receiver                (arrived ->) received -> landed -> issued -> recorded -> acked

(With early signals, CUDA's default, a bucket is signalled once its copies are queued: its
``copied`` stamp is its ``queued`` one, and the receiver's ``landed`` says when it saw the
copies done.)

``summarize`` gives each link's median and total in milliseconds, plus the period (the time
between two buckets' signals) that the whole push is made of.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

LINKS = (
    # (name, from, to): sender stamps are plain, receiver stamps are "r."
    ("sender: wait for the buffer's acks", "waited", "free"),
    ("sender: wait for its loads on the device", "free", "loads_done"),
    ("sender: queue the copies", "loads_done", "queued"),
    ("sender: copies on the device", "queued", "copied"),
    ("sender: send the signal", "copied", "signalled"),
    ("copied -> receiver has the signal", "copied", "r.received"),
    ("signal sent -> the receiver's socket had it", "signalled", "r.arrived"),
    ("receiver: read and check the signal", "r.arrived", "r.received"),
    ("receiver: wait for the sender's copies", "r.received", "r.landed"),
    ("receiver: issue the loads", "r.landed", "r.issued"),
    ("receiver: record the load event", "r.issued", "r.recorded"),
    ("receiver: send the ack", "r.recorded", "r.acked"),
)


def _rows(times: Iterable[Any]) -> list[dict[str, float]]:
    return [asdict(t) if is_dataclass(t) else dict(t) for t in times]  # type: ignore[arg-type]


def summarize(
    sender: Iterable[Any], receiver: Iterable[Mapping[str, float]] | Iterable[Any], *, buffers: int
) -> dict[str, Any]:
    """Median and total (ms) of each link over the buckets both sides stamped."""
    theirs = {int(r["bucket"]): r for r in _rows(receiver)}
    links: dict[str, list[float]] = {name: [] for name, _, _ in LINKS}
    acks: list[float] = []
    ours = _rows(sender)
    for row in ours:
        r = theirs.get(int(row["bucket"]))
        for name, start, end in LINKS:
            a = r.get(start[2:]) if start.startswith("r.") and r else row.get(start)
            b = r.get(end[2:]) if end.startswith("r.") and r else row.get(end)
            if a is not None and b is not None and not (start.startswith("r.") and r is None):
                links[name].append(b - a)
    # An ack reaching the sender: from the receiver's ack of bucket k to the sender seeing the
    # buffer free for the bucket that reuses it (only where the sender was still waiting).
    for row in ours:
        earlier = theirs.get(int(row["bucket"]) - buffers)
        if earlier is not None and row["free"] > earlier["acked"]:
            acks.append(row["free"] - earlier["acked"])
    out: dict[str, Any] = {
        name: {"median_ms": _ms(statistics.median(v)), "total_ms": _ms(sum(v))}
        for name, v in links.items()
        if v
    }
    if acks:
        out["ack -> sender sees the buffer free"] = {
            "median_ms": _ms(statistics.median(acks)),
            "total_ms": _ms(sum(acks)),
        }
    signals = [row["signalled"] for row in ours]
    if len(signals) > 1:
        out["period (signal to signal)"] = {
            "median_ms": _ms(statistics.median(b - a for a, b in itertools.pairwise(signals))),
            "total_ms": _ms(signals[-1] - signals[0]),
        }
    out["buckets"] = len(ours)
    return out


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def render(summary: Mapping[str, Any]) -> str:
    lines = [f"    {'link':44s} {'median ms':>10s} {'total ms':>10s}"]
    for name, v in summary.items():
        if isinstance(v, dict):
            lines.append(f"    {name:44s} {v['median_ms']:10.3f} {v['total_ms']:10.2f}")
        elif isinstance(v, float):
            lines.append(f"    {name:44s} {v:10.3f}")
    return "\n".join(lines)
