"""What an update report says, what ``statistics()`` keeps, and the Prometheus endpoint, scraped
with a real HTTP client while a real engine serves and takes a push."""

from __future__ import annotations

import asyncio
import math
import socket
from pathlib import Path

import httpx
import pytest
from engine_helpers import HANG, load_weights
from prometheus_client.parser import text_string_to_metric_families

from asyncroll import (
    AsyncServerManager,
    InvalidRequestError,
    VLLMEngine,
    serve_metrics,
)
from asyncroll.metrics import STALENESS_BOUNDS, Histogram, staleness_runs


def test_histogram_counts_into_buckets_and_bounds_quantiles() -> None:
    h = Histogram((1, 2, 4))
    for value in (0, 1, 1.5, 3, 9):
        h.observe(value)
    h.observe(2, times=5)
    s = h.snapshot()
    assert s.counts == (2, 6, 1, 1) and s.count == 10 and s.sum == pytest.approx(24.5)
    assert s.quantile(0.5) == 2 and s.quantile(0.95) == math.inf and s.quantile(0.1) == 1
    assert math.isnan(Histogram((1,)).snapshot().quantile(0.5))


def test_staleness_runs_count_tokens_per_version_behind() -> None:
    steps = (3, 3, 4, 4, 4, None, 5, 5)
    assert list(staleness_runs(steps, 5)) == [(2, 2), (1, 3), (0, 2)]
    assert list(staleness_runs(steps, None)) == []
    assert list(staleness_runs((), 5)) == []
    assert list(staleness_runs((None, None), 5)) == []
    assert list(staleness_runs((7,), 5)) == [(0, 1)]  # never negative


@pytest.mark.parametrize("port", [-1, 65536, "9400", 1.5, True])
def test_a_bad_metrics_port_is_refused_before_anything_binds(port: object) -> None:
    from asyncroll.testing import FakeEngine

    manager = AsyncServerManager([FakeEngine(name="fake")])
    with pytest.raises(InvalidRequestError, match="port must be an int"):
        serve_metrics(manager, port=port)  # type: ignore[arg-type]


def test_a_taken_port_is_an_os_error() -> None:
    from asyncroll.testing import FakeEngine

    manager = AsyncServerManager([FakeEngine(name="fake")])
    with serve_metrics(manager) as first, pytest.raises(OSError):
        serve_metrics(manager, port=first.port)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.mark.engine
async def test_an_update_report_says_what_each_engine_took_and_statistics_keep_it(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    weights = load_weights(tiny_model_a)
    steps = (engine.global_steps or 0) + 1
    async with AsyncServerManager([engine]) as manager:
        report = await manager.update_weights(weights, global_steps=steps)
        stats = manager.statistics()
    assert report.global_steps == steps
    assert report.tensors == len(weights)
    assert report.bytes == sum(t.numel() * t.element_size() for t in weights.values())
    assert report.push is not None and report.push.bytes >= report.bytes
    assert report.gb_per_s > 0
    delivery = report.deliveries[engine.name]
    assert delivery.version == steps and delivery.workers == engine.weights.num_workers
    assert delivery.tensors == len(weights) * engine.weights.num_workers
    assert delivery.bytes >= report.bytes
    # The CPU build's layerwise load: the norms, the embedding and the head are found whole
    # (the linear weights are repacked); every tensor is counted one way or the other.
    assert delivery.verified > 0 and report.verified == delivery.verified
    assert delivery.verified + delivery.not_verifiable == delivery.tensors
    assert stats.recent_updates == (report,)
    assert stats.num_updates == 1 and stats.num_failed_updates == 0
    assert stats.pushed_bytes == report.bytes and stats.verified_tensors == delivery.verified
    assert {k: v.count for k, v in stats.update_seconds.items()} == {
        "pause": 1, "push": 1, "finish": 1, "resume": 1, "total": 1
    }
    assert stats.update_seconds["total"].sum == pytest.approx(report.seconds)


@pytest.mark.engine
async def test_the_prometheus_endpoint_agrees_with_statistics(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    params = {"max_tokens": 6, "ignore_eos": True}
    steps = (engine.global_steps or 0) + 1
    async with (
        AsyncServerManager([engine]) as manager,
        serve_metrics(manager) as server,
        httpx.AsyncClient(timeout=HANG) as client,
    ):
        assert server.url.startswith("http://127.0.0.1:")
        outputs = list(
            await asyncio.gather(
                *(manager.generate(f"m{i}", prompt_ids=[5, 6, i + 7], sampling_params=params)
                  for i in range(4))
            )
        )
        with pytest.raises(InvalidRequestError):
            await manager.generate("bad", prompt_ids=[10**9], sampling_params=params)
        await manager.update_weights(load_weights(tiny_model_a), global_steps=steps)
        outputs.append(await manager.generate("after", prompt_ids=[9, 9], sampling_params=params))
        response = await client.get(server.url)
        stats = manager.statistics()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    got = _samples(response.text)
    assert got[("asyncroll_requests_total", ())] == stats.num_requests == 5
    assert got[("asyncroll_rejected_requests_total", ())] == stats.num_rejected == 1
    assert got[("asyncroll_weight_updates_total", (("outcome", "ok"),))] == 1
    assert got[("asyncroll_weight_updates_total", (("outcome", "failed"),))] == 0
    assert got[("asyncroll_global_steps", ())] == steps
    assert got[("asyncroll_engines", (("state", "alive"),))] == 1
    assert got[("asyncroll_requests_in_flight", (("engine", engine.name),))] == 0
    assert got[("asyncroll_weight_push_bytes_total", ())] == stats.pushed_bytes > 0
    assert got[("asyncroll_weight_push_gigabytes_per_second", ())] > 0
    assert got[("asyncroll_weight_tensors_verified_total", ())] == stats.verified_tensors > 0
    total = (("stage", "total"),)
    assert got[("asyncroll_weight_update_seconds_count", total)] == 1
    assert got[("asyncroll_weight_update_seconds_sum", total)] == pytest.approx(
        stats.update_seconds["total"].sum
    )
    assert got[("asyncroll_weight_update_seconds_bucket", (("le", "+Inf"), *total))] == 1
    # Every returned token of a known version is counted once, by how stale it was.
    tokens = sum(sum(s is not None for s in o.global_steps) for o in outputs)
    assert tokens > 0
    assert got[("asyncroll_token_staleness_count", ())] == tokens == stats.token_staleness.count
    assert got[("asyncroll_token_staleness_bucket", (("le", "+Inf"),))] == tokens
    first = (("le", repr(float(STALENESS_BOUNDS[0]))),)
    assert got[("asyncroll_token_staleness_bucket", first)] == stats.token_staleness.counts[0]
    # Closed with the context: the port is free again.
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", server.port)) != 0
