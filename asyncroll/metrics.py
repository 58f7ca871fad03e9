"""Counters the manager keeps, and an optional Prometheus endpoint that reads them.

The manager counts as it goes (a few integer additions per call and per update, no lock, no
thread); ``serve_metrics`` starts an HTTP endpoint whose collector reads
``manager.statistics()`` at each scrape, so nothing is pushed and nothing is kept twice.
``prometheus_client`` is an optional dependency (``pip install asyncroll[metrics]``; vLLM brings
it too), imported only by ``serve_metrics``.

What is exported (names and labels after Prometheus' conventions: ``_total`` counters, base
units, ``le`` buckets)::

    asyncroll_requests_total                      counter    calls to generate
    asyncroll_requests_in_flight{engine}          gauge      segments running on each engine
    asyncroll_engine_busy_seconds_total{engine}   counter    time with a segment in flight there
    asyncroll_request_resumes_total               counter    segments resubmitted after an update
    asyncroll_reprefill_tokens_total              counter    prompt + output tokens prefilled again
    asyncroll_engine_failovers_total              counter    segments moved off a dead engine
    asyncroll_rejected_requests_total             counter    calls refused for bad input
    asyncroll_engines{state}                      gauge      engines alive / dead
    asyncroll_global_steps                        gauge      the published weight version
    asyncroll_token_staleness                     histogram  versions behind, per token returned
    asyncroll_weight_updates_total{outcome}       counter    updates ok / failed
    asyncroll_weight_update_seconds{stage}        histogram  pause, push, finish (the commit),
                                                             resume, total
    asyncroll_weight_push_bytes_total             counter    bytes pushed (to each engine)
    asyncroll_weight_push_gigabytes_per_second    gauge      the last push's rate
    asyncroll_weight_tensors_verified_total       counter    loads checked against fingerprints

Staleness per token p50/p99: ``histogram_quantile(0.99, asyncroll_token_staleness_bucket)``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from asyncroll.errors import InvalidRequestError
from asyncroll.types import HistogramSnapshot, ManagerStatistics, UpdateReport

__all__ = [
    "SECONDS_BOUNDS",
    "STAGES",
    "STALENESS_BOUNDS",
    "Histogram",
    "MetricsServer",
    "UpdateMetrics",
    "serve_metrics",
]

STAGES = ("pause", "push", "finish", "resume", "total")
SECONDS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STALENESS_BOUNDS = (0, 1, 2, 3, 4, 8, 16)


class Observed(Protocol):
    """What ``serve_metrics`` reads: an ``AsyncServerManager``."""

    def statistics(self) -> ManagerStatistics: ...


class Histogram:
    """Counts observations into fixed buckets (``HistogramSnapshot`` says which)."""

    __slots__ = ("_count", "_counts", "_sum", "bounds")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += times
        self._sum += value * times
        self._count += times

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(
            bounds=self.bounds, counts=tuple(self._counts), sum=self._sum, count=self._count
        )


class UpdateMetrics:
    """What the successful weight updates took, summed and bucketed."""

    def __init__(self) -> None:
        self.seconds = {stage: Histogram(SECONDS_BOUNDS) for stage in STAGES}
        self.pushed_bytes = 0
        self.verified_tensors = 0

    def observe(self, report: UpdateReport) -> None:
        for stage, value in zip(
            STAGES,
            (report.pause_seconds, report.push_seconds, report.finish_seconds,
             report.resume_seconds, report.seconds),
            strict=True,
        ):
            self.seconds[stage].observe(value)
        self.pushed_bytes += report.bytes
        self.verified_tensors += report.verified


def staleness_runs(
    global_steps: Sequence[int | None], published: int | None
) -> Iterator[tuple[int, int]]:
    """(staleness, tokens) for each run of tokens of one version (unknown versions skipped)."""
    if published is None or not global_steps:
        return
    run_start, current = 0, global_steps[0]
    for i in range(1, len(global_steps) + 1):
        step = global_steps[i] if i < len(global_steps) else object()
        if step != current:
            if isinstance(current, int):
                yield max(published - current, 0), i - run_start
            if i < len(global_steps):
                run_start, current = i, global_steps[i]


class MetricsServer:
    """A running Prometheus endpoint (``serve_metrics``); ``close`` stops it. Also an async
    and a sync context manager."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        host, port = server.server_address[:2]
        self.port: int = port
        self.url = f"http://{host}:{port}/metrics"

    def __repr__(self) -> str:
        return f"<MetricsServer {self.url}>"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> MetricsServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def serve_metrics(
    manager: Observed, *, port: int = 0, host: str = "127.0.0.1"
) -> MetricsServer:
    """Serve the manager's metrics at ``http://host:port/metrics`` (``port=0``: any free port,
    see ``MetricsServer.url``) from a daemon thread. Localhost by default.

    Raises:
        InvalidRequestError: ``port`` is not an int in [0, 65535], or ``prometheus_client`` is
            not installed.
        OSError: the address cannot be bound (the port is taken).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidRequestError(f"port must be an int in [0, 65535], not {port!r}")
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise InvalidRequestError(
            "serve_metrics needs prometheus_client: pip install 'asyncroll[metrics]'"
        ) from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(manager))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)


class _Collector:
    """Reads ``manager.statistics()`` at each scrape (from the server's thread: the manager's
    counters are plain ints and the snapshot copies them)."""

    def __init__(self, manager: Observed) -> None:
        self._manager = manager

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        s = self._manager.statistics()

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"asyncroll_{name}", doc, value=value)

        yield counter("requests", "Calls to generate.", s.num_requests)
        in_flight = GaugeMetricFamily(
            "asyncroll_requests_in_flight", "Segments running on each engine.", labels=["engine"]
        )
        for engine, n in s.in_flight_per_engine.items():
            in_flight.add_metric([engine], n)
        yield in_flight
        busy = CounterMetricFamily(
            "asyncroll_engine_busy_seconds",
            "Seconds each engine had a segment in flight (rate: its busy share).",
            labels=["engine"],
        )
        for engine, busy_seconds in s.busy_seconds.items():
            busy.add_metric([engine], busy_seconds)
        yield busy
        yield counter("request_resumes", "Segments resubmitted after a weight update.",
                      s.num_preempted)
        yield counter("reprefill_tokens", "Prompt and output tokens prefilled again on resume.",
                      s.num_reprefill_tokens)
        yield counter("engine_failovers", "Segments moved off a dead engine.",
                      s.num_engine_failovers)
        yield counter("rejected_requests", "Calls refused for bad input.", s.num_rejected)
        engines = GaugeMetricFamily("asyncroll_engines", "Engines by state.", labels=["state"])
        engines.add_metric(["alive"], s.alive_engines)
        engines.add_metric(["dead"], len(s.in_flight_per_engine) - s.alive_engines)
        yield engines
        if s.global_steps is not None:
            yield GaugeMetricFamily(
                "asyncroll_global_steps", "The published weight version.", value=s.global_steps
            )
        if s.token_staleness is not None:
            yield _histogram(
                HistogramMetricFamily, "asyncroll_token_staleness",
                "Versions the weights of each returned token were behind the published ones.",
                s.token_staleness,
            )
        updates = CounterMetricFamily(
            "asyncroll_weight_updates", "Weight updates by outcome.", labels=["outcome"]
        )
        updates.add_metric(["ok"], s.num_updates)
        updates.add_metric(["failed"], s.num_failed_updates)
        yield updates
        seconds = HistogramMetricFamily(
            "asyncroll_weight_update_seconds", "Weight update time by stage.", labels=["stage"]
        )
        for stage, snapshot in s.update_seconds.items():
            seconds.add_metric([stage], _buckets(snapshot), sum_value=snapshot.sum)
        yield seconds
        yield counter("weight_push_bytes", "Bytes pushed to each engine.", s.pushed_bytes)
        if s.recent_updates:
            yield GaugeMetricFamily(
                "asyncroll_weight_push_gigabytes_per_second", "The last push's rate.",
                value=s.recent_updates[-1].gb_per_s,
            )
        yield counter("weight_tensors_verified", "Loads checked against the trainer's "
                      "fingerprints.", s.verified_tensors)


def _buckets(snapshot: HistogramSnapshot) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    seen = 0
    for bound, n in zip((*snapshot.bounds, float("inf")), snapshot.counts, strict=True):
        seen += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), seen))
    return out


def _histogram(family: Any, name: str, doc: str, snapshot: HistogramSnapshot) -> Any:
    return family(name, doc, buckets=_buckets(snapshot), sum_value=snapshot.sum)
