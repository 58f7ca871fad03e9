"""LoRA adapters pushed through asyncroll's transport into a real vLLM engine's LoRA, by revision.

One engine with LoRA on (a tiny Qwen2 at weight scale 0.2, rank up to 8, four revisions a step,
four held) serves the module. A pushed adapter must sample what vLLM samples with the same
adapter loaded from a PEFT folder; a call keeps its revision through pushes; bad adapters never
reach the engine; the reference trainer's adapter, pushed every step, raises the reward. (At
the default scale of 0.02 the tiny model's frozen head cannot learn the band task through a
LoRA of its linear layers: ``examples/_common.LORA_TINY_STD``.)
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import ENGINE_ARGS, inject_fault, steps_held, until_decoding

from asyncroll import (
    AsyncServerManager,
    InvalidRequestError,
    VLLMEngine,
    WeightPusher,
    WeightSyncError,
)
from asyncroll import adapters as adapters_module
from asyncroll import weights as weights_module
from asyncroll.adapters import AdapterConfig
from asyncroll.recipes import BandTask, run_fully_async
from asyncroll.testing import make_tiny_model, vllm_client
from asyncroll.testing.contract import LateAction, retry_if_late
from asyncroll.testing.lora import random_adapter, write_peft_adapter
from asyncroll.trainer import ReferenceTrainer

pytestmark = pytest.mark.engine

CONFIG = AdapterConfig(rank=8, alpha=16)
LORA_ARGS: dict[str, Any] = {
    **ENGINE_ARGS,
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 4,
    "max_cpu_loras": 4,
}
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 12]
GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
_ids = itertools.count()


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora-model"), seed=0, init_std=0.2)


@pytest.fixture(scope="module")
async def lora_engine(lora_model: Path) -> AsyncIterator[VLLMEngine]:
    async with VLLMEngine.launch(lora_model, name="lora", **LORA_ARGS) as engine:
        yield engine


@pytest.fixture
async def manager(lora_engine: VLLMEngine) -> AsyncIterator[AsyncServerManager]:
    async with AsyncServerManager([lora_engine]) as manager:
        yield manager
    for revision in lora_engine.adapters.held:  # the next test starts with none
        await lora_engine.adapters.drop(revision)


def adapter(model: Path, seed: int) -> dict[str, torch.Tensor]:
    return random_adapter(model, CONFIG, seed=seed, scale=0.5)


async def outputs(
    manager: AsyncServerManager, adapter: str | None, params: dict[str, Any] = GREEDY
) -> list[tuple[int, ...]]:
    results = await asyncio.gather(*(
        manager.generate(f"lora-{next(_ids)}", prompt_ids=p, sampling_params=params,
                         adapter=adapter)
        for p in PROMPTS
    ))
    return [r.token_ids for r in results]


async def vllms_own(engine: VLLMEngine, folder: Path, lora_id: int) -> list[tuple[int, ...]]:
    """Greedy outputs with the adapter vLLM loads itself from a PEFT folder."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    client = vllm_client(engine)
    request = LoRARequest(f"peft-{lora_id}", lora_id, str(folder))
    found = []
    for prompt in PROMPTS:
        last = None
        async for out in client.generate(
            TokensPrompt(prompt_token_ids=prompt), SamplingParams(**GREEDY),
            f"peft-{next(_ids)}", lora_request=request,
        ):
            last = out
        assert last is not None
        found.append(tuple(last.outputs[0].token_ids))
    return found


async def test_a_pushed_adapter_samples_what_vllm_samples_with_it_from_a_peft_folder(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path, tmp_path: Path
) -> None:
    tensors = adapter(lora_model, seed=1)
    base = await outputs(manager, None)
    report = await manager.update_adapter("math", tensors, config=CONFIG, global_steps=3)
    assert report.revision.global_steps == 3 and report.tensors == len(tensors)
    assert report.deliveries[lora_engine.name].verified == len(tensors)
    pushed = await outputs(manager, "math")
    reference = await vllms_own(lora_engine, write_peft_adapter(tmp_path, tensors, CONFIG), 900)
    assert pushed == reference
    assert pushed != base  # the adapter changes what is sampled
    assert await outputs(manager, None) == base  # and only under it


async def test_each_call_runs_under_its_own_adapter(
    manager: AsyncServerManager, lora_model: Path
) -> None:
    await manager.update_adapter("a", adapter(lora_model, 2), config=CONFIG, global_steps=1)
    await manager.update_adapter("b", adapter(lora_model, 3), config=CONFIG, global_steps=5)
    alone_a, alone_b = await outputs(manager, "a"), await outputs(manager, "b")
    assert alone_a != alone_b
    mixed = await asyncio.gather(outputs(manager, "a"), outputs(manager, "b"))
    assert mixed == [alone_a, alone_b]
    result = await manager.generate("steps-b", prompt_ids=PROMPTS[0], sampling_params=GREEDY,
                                    adapter="b")
    assert set(result.global_steps) == {5}


@retry_if_late
async def _keeps_its_revision(manager: AsyncServerManager, model: Path) -> None:
    long = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    first = await manager.update_adapter("p", adapter(model, 10), config=CONFIG, global_steps=1)
    alone = await manager.generate(f"alone-{next(_ids)}", prompt_ids=PROMPTS[1],
                                   sampling_params=long, adapter="p")
    call = asyncio.ensure_future(manager.generate(
        f"spanning-{next(_ids)}", prompt_ids=PROMPTS[1], sampling_params=long, adapter="p"))
    await until_decoding(manager, [call])
    reports = [
        await manager.update_adapter("p", adapter(model, 11 + i), config=CONFIG,
                                     global_steps=2 + i)
        for i in range(3)
    ]
    if call.done():
        raise LateAction("the call ended before the third push")
    result = await call
    assert result.token_ids == alone.token_ids  # as if the first revision were the only one
    assert set(result.global_steps) == {1}
    assert manager.adapters["p"] == reports[-1].revision
    # The first revision stayed while the call used it; once it ended, the next push drops it.
    assert first.revision.revision not in {r for rep in reports for r in rep.dropped}
    after = await manager.update_adapter("p", adapter(model, 20), config=CONFIG, global_steps=9)
    assert first.revision.revision in after.dropped
    fresh = await manager.generate(f"fresh-{next(_ids)}", prompt_ids=PROMPTS[1],
                                   sampling_params=long, adapter="p")
    assert set(fresh.global_steps) == {9} and fresh.token_ids != alone.token_ids


async def test_a_call_keeps_its_revision_through_three_pushes(
    manager: AsyncServerManager, lora_model: Path
) -> None:
    await _keeps_its_revision(manager, lora_model)


@retry_if_late
async def _removed(engine: VLLMEngine, manager: AsyncServerManager, model: Path) -> None:
    long = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    first = await manager.update_adapter("gone", adapter(model, 70), config=CONFIG,
                                         global_steps=1)
    kept = await manager.update_adapter("kept", adapter(model, 71), config=CONFIG,
                                        global_steps=1)
    alone = await manager.generate(f"alone-{next(_ids)}", prompt_ids=PROMPTS[1],
                                   sampling_params=long, adapter="gone")
    call = asyncio.ensure_future(manager.generate(
        f"running-{next(_ids)}", prompt_ids=PROMPTS[1], sampling_params=long, adapter="gone"))
    await until_decoding(manager, [call])
    assert await manager.remove_adapter("gone") == []  # in use: it stays while the call runs
    if call.done():
        raise LateAction("the call ended before the adapter was removed")
    assert "gone" not in manager.adapters
    with pytest.raises(InvalidRequestError, match="'gone' has no revision"):
        await manager.generate(f"late-{next(_ids)}", prompt_ids=PROMPTS[0],
                               sampling_params=GREEDY, adapter="gone")
    result = await call
    assert result.token_ids == alone.token_ids and set(result.global_steps) == {1}
    assert first.revision.revision in await vllm_client(engine).list_loras()
    # Its call over, the next push drops it, as any superseded revision.
    report = await manager.update_adapter("kept", adapter(model, 72), config=CONFIG,
                                          global_steps=2)
    assert first.revision.revision in report.dropped
    assert first.revision.revision not in await vllm_client(engine).list_loras()
    # An adapter no call uses leaves every engine at once; an unknown one is refused.
    left = await manager.remove_adapter("kept")  # its newest, and the one it superseded
    assert sorted(left, key=lambda r: r.revision) == [kept.revision, report.revision]
    assert not {r.revision for r in left} & set(await vllm_client(engine).list_loras())
    assert manager.adapters == {}
    with pytest.raises(InvalidRequestError, match="'kept' has no revision"):
        await manager.remove_adapter("kept")


async def test_a_removed_adapter_takes_no_new_call_and_leaves_once_its_calls_end(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path
) -> None:
    await _removed(lora_engine, manager, lora_model)


def _broken(what: str) -> Any:
    def broken(*args: object, **kwargs: object) -> Any:
        raise RuntimeError(f"the {what} broke")

    return broken


async def _fails_and_serves_on(
    manager: AsyncServerManager, name: str, tensors: dict[str, torch.Tensor], what: str,
    served: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push of adapter ``name`` fails where ``what`` was patched to break; once the patch
    is undone, the revision in use still serves (the engine steps again)."""
    steps = manager.adapters[name].global_steps
    assert steps is not None
    with pytest.raises(WeightSyncError, match=f"the {what} broke"):
        await manager.update_adapter(name, tensors, config=CONFIG, global_steps=steps + 1)
    monkeypatch.undo()
    assert manager.adapters[name].global_steps == steps
    assert await outputs(manager, name) == served


async def test_a_push_whose_prints_fail_mid_push_fails_the_worker_and_the_revision_serves_on(
    lora_engine: VLLMEngine, lora_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trainer's fingerprints are taken once the sender has signalled the pack's bucket:
    # the worker is then receiving the push inside its engine's step loop. A failure there
    # must end the push in the worker (the sender's End names it), and the revision in use
    # must serve on. The push's deadline is an hour here: a worker
    # left waiting would stop the engine's steps past the test's own timeout.
    pusher = WeightPusher([lora_engine], timeout=3600.0)
    try:
        async with AsyncServerManager([lora_engine], weights=pusher) as manager:
            manager.land_adapters = False  # each revision in one RPC between two steps
            await manager.update_adapter("f", adapter(lora_model, 90), config=CONFIG,
                                         global_steps=1)
            served = await outputs(manager, "f")
            monkeypatch.setattr(weights_module, "packed_fingerprints", _broken("fingerprints"))
            await _fails_and_serves_on(manager, "f", adapter(lora_model, 91), "fingerprints",
                                       served, monkeypatch)
            await manager.update_adapter("f", adapter(lora_model, 92), config=CONFIG,
                                         global_steps=3)
            assert await outputs(manager, "f") != served
    finally:
        await pusher.aclose()
        for revision in lora_engine.adapters.held:
            await lora_engine.adapters.drop(revision)


async def test_a_later_push_writes_its_pack_while_the_take_travels_and_a_failure_there_calls_it_off(
    lora_engine: VLLMEngine, lora_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A layout's first push packs before anything leaves; each later one writes the kept
    # pack, and checks it finite, once the take's RPC has left, so the copy overlaps the
    # RPC's way to the worker; its fingerprints are taken once the sender has signalled the
    # bucket, while the worker copies it. The pack must then hold the new revision's values when the
    # sender reads it, and a failure while writing it (or a value that is not finite) must
    # call the waiting worker off, the revision in use serving on.
    pusher = WeightPusher([lora_engine], timeout=3600.0)  # a worker left waiting: a timeout
    try:
        async with AsyncServerManager([lora_engine], weights=pusher) as manager:
            manager.land_adapters = False  # each revision in one RPC between two steps
            first = await manager.update_adapter("w", adapter(lora_model, 93), config=CONFIG,
                                                 global_steps=1)
            assert "filling" not in first.stamps  # packed before the take left
            tensors = adapter(lora_model, 94)
            later = await manager.update_adapter("w", tensors, config=CONFIG, global_steps=2)
            at = later.stamps
            assert "packed" in first.stamps and "packed" not in at
            assert at["checked"] <= at["take left"] <= at["filling"]
            assert at["filling"] <= at["filled"] <= at["printed"]
            # The fingerprints: once the bucket is copied and signalled (the worker copies
            # out meanwhile).
            assert later.push is not None and at["filled"] <= later.push.began
            assert later.push.timeline[0].copied <= at["printed"]
            assert later.deliveries[lora_engine.name].verified == len(tensors)
            served = await outputs(manager, "w")
            folder = write_peft_adapter(tmp_path, tensors, CONFIG)
            assert served == await vllms_own(lora_engine, folder, 904)

            plan = manager._adapter_plans.plan(tensors)[0]
            monkeypatch.setattr(type(plan), "pack", _broken("pack"))
            await _fails_and_serves_on(manager, "w", adapter(lora_model, 95), "pack", served,
                                       monkeypatch)
            nan = {name: torch.full_like(t, float("nan")) for name, t in tensors.items()}
            with pytest.raises(InvalidRequestError, match="non-finite"):
                await manager.update_adapter("w", nan, config=CONFIG, global_steps=3)
            assert manager.adapters["w"].global_steps == 2
            assert await outputs(manager, "w") == served
            await manager.update_adapter("w", adapter(lora_model, 96), config=CONFIG,
                                         global_steps=4)
            assert await outputs(manager, "w") != served
            # A host pack too large to write on the loop is packed before the take leaves.
            monkeypatch.setattr(adapters_module, "FILL_ON_LOOP_BYTES", 0)
            big = await manager.update_adapter("w", tensors, config=CONFIG, global_steps=5)
            assert "packed" in big.stamps and "filling" not in big.stamps
            assert await outputs(manager, "w") == served  # the pack holds the revision
    finally:
        await pusher.aclose()
        await vllm_client(lora_engine).remove_lora(904)
        for revision in lora_engine.adapters.held:
            await lora_engine.adapters.drop(revision)


async def test_later_revisions_land_while_the_engine_takes_no_step_and_the_next_calls_run_on_them(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path, tmp_path: Path
) -> None:
    # A layout's first revision goes in one RPC between two steps; later ones land on the
    # worker's own thread while the engine steps, checked there, and their registration is
    # queued on the engine's input ahead of every call sent after it. Here the engine's step
    # loop is held (an RPC that waits) while two revisions are pushed: both pushes return
    # all the same, and the call made after each runs on it once the loop goes on, token for
    # token as vLLM's own load of it from a PEFT folder.
    port = lora_engine.adapters
    failures = len(port.registration_failures)
    await manager.update_adapter("l", adapter(lora_model, 60), config=CONFIG, global_steps=1)
    await manager.update_adapter("l", adapter(lora_model, 61), config=CONFIG, global_steps=2)
    assert (await port.registered_last())[0]["registered"] in ("replayed", "vllm")
    revisions = [adapter(lora_model, 62), adapter(lora_model, 63)]
    calls = []
    async with steps_held(lora_engine) as hold:
        registered = port.registered
        for step, tensors in enumerate(revisions, start=3):
            report = await manager.update_adapter("l", tensors, config=CONFIG,
                                                  global_steps=step)
            assert not hold.done()  # it returned while the engine took no step
            assert port.registered == registered  # and its registration has not run yet
            assert "verdicts" in report.stamps  # (it landed)
            assert report.deliveries[lora_engine.name].verified == len(tensors)
            calls.append(asyncio.ensure_future(outputs(manager, "l")))  # behind it
    answers = await port.registered_last()
    assert answers[0]["registered"] == "replayed" and answers[0]["verified"] == [len(tensors), 0]
    for lora_id, (call, tensors) in enumerate(zip(calls, revisions, strict=True), start=905):
        folder = write_peft_adapter(tmp_path / str(lora_id), tensors, CONFIG)
        assert await call == await vllms_own(lora_engine, folder, lora_id)
        await vllm_client(lora_engine).remove_lora(lora_id)
    assert len(port.registration_failures) == failures


async def test_a_landed_revision_whose_registration_fails_is_served_from_where_it_landed(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path, tmp_path: Path
) -> None:
    # The push has returned before its registration runs: a registration that fails in the
    # worker must not lose the revision. The worker keeps it as it landed, and vLLM builds it
    # when a step first needs it: the calls on it sample what vLLM samples from a PEFT folder.
    port = lora_engine.adapters
    await manager.update_adapter("k", adapter(lora_model, 80), config=CONFIG, global_steps=1)
    await manager.update_adapter("k", adapter(lora_model, 81), config=CONFIG, global_steps=2)
    failures = len(port.registration_failures)
    tensors = adapter(lora_model, 82)
    async with inject_fault(lora_engine, "register"):
        report = await manager.update_adapter("k", tensors, config=CONFIG, global_steps=3)
        answers = await port.registered_last()
    assert "verdicts" in report.stamps
    assert answers[0]["registered"].startswith("held (RuntimeError: injected fault")
    assert len(port.registration_failures) == failures + 1
    folder = write_peft_adapter(tmp_path, tensors, CONFIG)
    assert await outputs(manager, "k") == await vllms_own(lora_engine, folder, 907)
    await vllm_client(lora_engine).remove_lora(907)
    later = await manager.update_adapter("k", adapter(lora_model, 83), config=CONFIG,
                                         global_steps=4)
    assert "verdicts" in later.stamps
    assert (await port.registered_last())[0]["registered"] in ("replayed", "vllm")


async def test_a_landed_revision_the_worker_finds_altered_is_refused_and_the_last_serves_on(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The landing thread checks each tensor against the trainer's fingerprint and answers the
    # sender: a mismatch fails the push (no registration leaves), the revision in use serves
    # on, and the thread lands the next push.
    await manager.update_adapter("a", adapter(lora_model, 70), config=CONFIG, global_steps=1)
    await manager.update_adapter("a", adapter(lora_model, 71), config=CONFIG, global_steps=2)
    served = await outputs(manager, "a")
    sent: list[str] = []
    rpc_sent = lora_engine.rpc_sent

    async def spied(method: str, **kwargs: Any) -> Any:
        sent.append(method)
        return await rpc_sent(method, **kwargs)

    monkeypatch.setattr(lora_engine, "rpc_sent", spied)
    real = weights_module.packed_fingerprints

    def altered(*args: Any, **kwargs: Any) -> dict[str, bytes]:
        prints = real(*args, **kwargs)
        name = next(iter(prints))
        return {**prints, name: bytes(b ^ 0xFF for b in prints[name])}

    monkeypatch.setattr(weights_module, "packed_fingerprints", altered)
    with pytest.raises(WeightSyncError, match=r"failed its check.*differ from what was pushed"):
        await manager.update_adapter("a", adapter(lora_model, 72), config=CONFIG,
                                     global_steps=3)
    monkeypatch.undo()
    assert sent == []  # no registration left
    assert manager.adapters["a"].global_steps == 2
    assert await outputs(manager, "a") == served
    # The next revision goes the step loop's way (telling every worker the layout again),
    # and the one after lands again.
    report = await manager.update_adapter("a", adapter(lora_model, 73), config=CONFIG,
                                          global_steps=4)
    assert "verdicts" not in report.stamps and await outputs(manager, "a") != served
    report = await manager.update_adapter("a", adapter(lora_model, 74), config=CONFIG,
                                          global_steps=5)
    assert "verdicts" in report.stamps
    # A revision that is not finite is refused on this path too before any byte leaves
    # (no registration either), and the next one still lands.
    served = await outputs(manager, "a")
    sent.clear()
    monkeypatch.setattr(lora_engine, "rpc_sent", spied)
    nan = {name: torch.full_like(t, float("nan")) for name, t in adapter(lora_model, 75).items()}
    with pytest.raises(InvalidRequestError, match="non-finite"):
        await manager.update_adapter("a", nan, config=CONFIG, global_steps=6)
    assert sent == [] and manager.adapters["a"].global_steps == 5
    assert await outputs(manager, "a") == served
    report = await manager.update_adapter("a", adapter(lora_model, 76), config=CONFIG,
                                          global_steps=7)
    assert "verdicts" in report.stamps and sent == ["asyncroll_register_adapter"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="one-copy pushes read CUDA IPC")
async def test_a_one_copy_push_of_gpu_tensors_samples_what_vllm_samples_from_a_peft_folder(
    lora_engine: VLLMEngine, lora_model: Path, tmp_path: Path
) -> None:
    # On a GPU the adapter's kept pack can be read in place by the workers (no staging):
    # the first revision through vLLM's activation, the later ones replayed, each the
    # adapter vLLM loads from a folder.
    pusher = WeightPusher([lora_engine], one_copy=True)
    try:
        async with AsyncServerManager([lora_engine], weights=pusher) as manager:
            for step in range(LORA_ARGS["max_loras"] + 2):
                tensors = {n: t.cuda() for n, t in adapter(lora_model, 100 + step).items()}
                report = await manager.update_adapter("gpu", tensors, config=CONFIG,
                                                      global_steps=step)
                assert report.deliveries[lora_engine.name].verified == len(tensors)
            assert lora_engine.adapters.last_registration == "replayed"
            folder = write_peft_adapter(tmp_path, {n: t.cpu() for n, t in tensors.items()},
                                        CONFIG)
            assert await outputs(manager, "gpu") == await vllms_own(lora_engine, folder, 905)
    finally:
        await pusher.aclose()
        await vllm_client(lora_engine).remove_lora(905)
        for revision in lora_engine.adapters.held:
            await lora_engine.adapters.drop(revision)


async def test_no_call_reads_a_prefix_another_revision_computed(
    manager: AsyncServerManager, lora_model: Path
) -> None:
    prompt = [7, 8, 9, 10] * 70  # two full KV blocks and more
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    await manager.update_adapter("c", adapter(lora_model, 30), config=CONFIG, global_steps=1)
    first = await manager.generate("c-1", prompt_ids=prompt, sampling_params=params, adapter="c")
    again = await manager.generate("c-2", prompt_ids=prompt, sampling_params=params, adapter="c")
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0  # the cache works
    await manager.update_adapter("c", adapter(lora_model, 31), config=CONFIG, global_steps=2)
    other = await manager.generate("c-3", prompt_ids=prompt, sampling_params=params, adapter="c")
    assert other.num_cached_tokens == 0  # the next revision computes its own prefix


async def test_revisions_never_pile_up_in_the_engine(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path
) -> None:
    tensors = [adapter(lora_model, 40), adapter(lora_model, 41)]
    pushed: set[int] = set()
    (memory,) = await lora_engine.collective_rpc("asyncroll_adapter_memory")
    made, seen = memory["landings"], set()
    for step in range(8):
        report = await manager.update_adapter(
            "many", tensors[step % 2], config=CONFIG, global_steps=step)
        pushed.add(report.revision.revision)
        held = {r.revision for r in lora_engine.adapters.held}
        assert len(held) <= 2  # the newest, and the one it superseded until the next push
        in_vllm = set(await vllm_client(lora_engine).list_loras()) & pushed
        assert in_vllm == held  # vLLM holds exactly those too
        # Each revision the worker holds lies in memory of its own; a dropped one's memory
        # (and the views made of it) takes the next revision, so a few landings serve them all.
        (memory,) = await lora_engine.collective_rpc("asyncroll_adapter_memory")
        assert set(memory["held"]) >= held
        addresses = [a for revision in held for a in memory["held"][revision]]
        assert len(addresses) == len(set(addresses))
        seen.update(addresses)
    assert memory["landings"] <= made + 3
    assert len(seen) <= 3 * len(addresses)  # 8 revisions in the memory of at most 3


async def test_a_revision_vllm_evicted_comes_back_from_memory_unchanged(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path
) -> None:
    # float32, as the engine serves: vLLM then folds alpha / rank into the very tensors it is
    # given, and a rebuild from what the worker kept must not fold it in twice.
    tensors = random_adapter(lora_model, CONFIG, seed=50, scale=0.5, dtype=torch.float32)
    report = await manager.update_adapter("back", tensors, config=CONFIG, global_steps=1)
    served = await outputs(manager, "back")
    assert await vllm_client(lora_engine).remove_lora(report.revision.revision)  # evicted
    assert report.revision.revision not in await vllm_client(lora_engine).list_loras()
    assert await outputs(manager, "back") == served  # rebuilt from the worker's memory


async def slot_digest(engine: VLLMEngine, revision: int) -> str:
    (digest,) = await engine.collective_rpc("asyncroll_lora_slot_digest", args=(revision,))
    assert digest is not None, f"revision {revision} holds no device slot"
    return str(digest)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
async def test_a_revision_written_by_replay_holds_what_vllm_writes_from_a_peft_folder(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path, tmp_path: Path,
    dtype: torch.dtype,
) -> None:
    # The first revision of a layout to reach a slot goes through vLLM's activation, which is
    # recorded; later ones are replayed into recorded slots. Fill every slot with one adapter,
    # then push another (other values, another alpha) into a slot the first one holds: the
    # replayed slot must hold the very bytes vLLM writes for the second adapter loaded from a
    # PEFT folder, and sample what vLLM samples with it.
    first = random_adapter(lora_model, CONFIG, seed=60, scale=0.5, dtype=dtype)
    for step in range(LORA_ARGS["max_loras"] + 1):
        await manager.update_adapter("replay", first, config=CONFIG, global_steps=step)
    config = AdapterConfig(rank=8, alpha=5)
    second = random_adapter(lora_model, config, seed=61, scale=0.5, dtype=dtype)
    report = await manager.update_adapter("replay", second, config=config, global_steps=9)
    assert lora_engine.adapters.last_registration == "replayed"
    replayed = await slot_digest(lora_engine, report.revision.revision)
    pushed = await outputs(manager, "replay")
    lora_id = 901 if dtype == torch.float32 else 902
    folder = write_peft_adapter(tmp_path, second, config)
    assert pushed == await vllms_own(lora_engine, folder, lora_id)
    try:
        assert await slot_digest(lora_engine, lora_id) == replayed
    finally:
        await vllm_client(lora_engine).remove_lora(lora_id)


async def test_a_replayed_revision_vllm_moves_out_of_its_slot_comes_back_unchanged(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path
) -> None:
    tensors = adapter(lora_model, 61)
    for step in range(LORA_ARGS["max_loras"] + 2):
        report = await manager.update_adapter("moved", tensors, config=CONFIG, global_steps=step)
    assert lora_engine.adapters.last_registration == "replayed"
    revision = report.revision.revision
    before = await slot_digest(lora_engine, revision)
    served = await outputs(manager, "moved")
    (moved,) = await lora_engine.collective_rpc("asyncroll_lora_deactivate", args=(revision,))
    assert moved
    (gone,) = await lora_engine.collective_rpc("asyncroll_lora_slot_digest", args=(revision,))
    assert gone is None
    # A step that needs it makes vLLM activate it again: from the kept tensors, never from the
    # weightless stand-in the replay registered.
    assert await outputs(manager, "moved") == served
    assert await slot_digest(lora_engine, revision) == before


async def test_an_adapters_layout_travels_once_and_again_to_a_worker_that_lost_it(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[dict[str, Any]] = []
    rpc = lora_engine.collective_rpc

    async def spied(method: str, **kwargs: Any) -> list[Any]:
        if method == "asyncroll_take_adapter":
            sent.append(kwargs["kwargs"])
        return await rpc(method, **kwargs)

    monkeypatch.setattr(lora_engine, "collective_rpc", spied)
    manager.land_adapters = False  # each revision in one RPC between two steps
    tensors = adapter(lora_model, 70)
    for step in range(2):
        await manager.update_adapter("layout", tensors, config=CONFIG, global_steps=step)
    carried = ["layout" in kwargs for kwargs in sent]
    assert carried[-1] is False  # the workers keep it: only its key travels
    await rpc("asyncroll_forget_adapter_layouts")
    with pytest.raises(WeightSyncError, match="unknown adapter layout"):
        await manager.update_adapter("layout", tensors, config=CONFIG, global_steps=2)
    served = await outputs(manager, "layout")  # the last revision still serves
    await manager.update_adapter("layout", tensors, config=CONFIG, global_steps=3)
    assert "layout" in sent[-1]  # sent again after the failure
    assert await outputs(manager, "layout") == served


async def test_bad_adapters_are_refused_before_anything_is_sent(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path
) -> None:
    good = adapter(lora_model, 4)
    await manager.update_adapter("ok", good, config=CONFIG, global_steps=2)
    served = await outputs(manager, "ok")
    held = lora_engine.adapters.held
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    q_b = q_a.replace("lora_A", "lora_B")
    wide = AdapterConfig(rank=16, alpha=16)
    cases: list[tuple[str, Any, AdapterConfig, Any]] = [
        ("rank above max_lora_rank", random_adapter(lora_model, wide), wide, 3),
        ("a rank other than the config's", good, AdapterConfig(rank=4, alpha=8), 3),
        ("a module the LoRA does not cover", {
            **good,
            "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 512),
            "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(128, 8),
        }, CONFIG, 3),
        ("a shape that does not fit", {**good, q_a: torch.zeros(8, 64)}, CONFIG, 3),
        ("a NaN", {**good, q_b: torch.full_like(good[q_b], float("nan"))}, CONFIG, 3),
        ("tensors on two devices", {**good, q_b: good[q_b].to("meta")}, CONFIG, 3),
        ("an A without its B", {q_a: good[q_a]}, CONFIG, 3),
        ("not a LoRA name", {"model.layers.0.self_attn.q_proj.weight": good[q_a]}, CONFIG, 3),
        ("global_steps below the last revision's", good, CONFIG, 1),
    ]
    for what, tensors, config, steps in cases:
        with pytest.raises(InvalidRequestError):
            await manager.update_adapter("ok", tensors, config=config, global_steps=steps)
        assert lora_engine.adapters.held == held, what
    with pytest.raises(InvalidRequestError, match="no revision"):
        await manager.generate("no-such", prompt_ids=PROMPTS[0], sampling_params=GREEDY,
                               adapter="never-pushed")
    with pytest.raises(InvalidRequestError):
        await manager.update_adapter("bad name!", good, config=CONFIG, global_steps=3)
    assert await outputs(manager, "ok") == served


async def test_a_manager_whose_pusher_lands_full_weights_pushes_adapters_beside_it(
    lora_engine: VLLMEngine, lora_model: Path, tmp_path: Path
) -> None:
    # A manager given WeightPusher(land=True) pushes full weights to the workers' landing
    # threads; its adapter pushes go through a pusher of their own, to the workers'
    # receivers, and serve as vLLM's own load of the same adapter does.
    pusher = WeightPusher([lora_engine], land=True, backup=True)
    tensors = adapter(lora_model, 71)
    try:
        async with AsyncServerManager([lora_engine], weights=pusher) as manager:
            await manager.update_adapter("w", tensors, config=CONFIG, global_steps=1)
            assert pusher.sender is None  # the manager's pusher moved no adapter byte
            folder = write_peft_adapter(tmp_path / "w", tensors, CONFIG)
            assert await outputs(manager, "w") == await vllms_own(lora_engine, folder, 911)
            await vllm_client(lora_engine).remove_lora(911)
    finally:
        await pusher.aclose()
        for revision in lora_engine.adapters.held:
            await lora_engine.adapters.drop(revision)


@pytest.fixture(scope="module")
async def tp_lora_engine(lora_model: Path) -> AsyncIterator[VLLMEngine]:
    async with VLLMEngine.launch(
        lora_model, name="lora-tp2", tensor_parallel_size=2, **LORA_ARGS
    ) as engine:
        yield engine


async def test_a_tensor_parallel_engine_serves_pushed_revisions_as_vllm_does_from_a_folder(
    tp_lora_engine: VLLMEngine, lora_model: Path, tmp_path: Path
) -> None:
    # Each worker receives the whole adapter and writes its own shard of every slot: vLLM's
    # activation (recorded) for the first revisions, a replay of it for the next. Both must
    # hold the very bytes vLLM writes for the adapter loaded from a PEFT folder, in each
    # worker, and sample what vLLM samples with it.
    engine = tp_lora_engine
    config = AdapterConfig(rank=8, alpha=5)
    tensors = random_adapter(lora_model, config, seed=80, scale=0.5)
    folder = write_peft_adapter(tmp_path, tensors, config)
    async with AsyncServerManager([engine]) as manager:
        first = await manager.update_adapter("tp", tensors, config=config, global_steps=0)
        assert engine.adapters.last_registration == "vllm"
        delivery = first.deliveries[engine.name]
        assert delivery.workers == 2 and delivery.verified == 2 * first.tensors
        served = await outputs(manager, "tp")
        assert served == await vllms_own(engine, folder, 903)
        theirs = await engine.collective_rpc("asyncroll_lora_slot_digest", args=(903,))
        for step in range(1, LORA_ARGS["max_loras"] + 2):
            report = await manager.update_adapter("tp", tensors, config=config,
                                                  global_steps=step)
        assert engine.adapters.last_registration == "replayed"
        replayed = await engine.collective_rpc(
            "asyncroll_lora_slot_digest", args=(report.revision.revision,))
        assert len(replayed) == 2 and None not in replayed
        assert replayed == theirs and replayed[0] != replayed[1]  # each worker its own shard
        assert await outputs(manager, "tp") == served
        await vllm_client(engine).remove_lora(903)


async def test_an_engine_started_without_lora_refuses_adapters(engine: VLLMEngine) -> None:
    async with AsyncServerManager([engine]) as manager:
        with pytest.raises(InvalidRequestError, match="without LoRA"):
            await manager.update_adapter(
                "x", random_adapter(engine.model_path, CONFIG), config=CONFIG, global_steps=1
            )


async def test_the_reference_trainers_adapter_is_served_as_trained_with_no_engine_pause(
    lora_engine: VLLMEngine, manager: AsyncServerManager, lora_model: Path
) -> None:
    """The fully-async recipe with a LoRA trainer: every step's adapter is pushed (no pause,
    labelled with its step), the base weights stay frozen and unpushed, and the engine samples
    with the trainer's own log probs. (Whether the tiny model then learns the band task varies
    from run to run: examples/_common.LORA_TINY_STD and docs/performance.md.)"""
    trainer = ReferenceTrainer(lora_model, device="cpu", lr=0.05, lora=CONFIG)
    base = {n: t.clone() for n, t in trainer.named_parameters()}
    task = BandTask()
    records = await run_fully_async(manager, trainer, task, steps=6, max_staleness=2)
    assert all(r.pause_seconds == 0 and r.staleness_max <= 2 for r in records)
    assert manager.adapters["policy"].global_steps == 6
    assert manager.global_steps == 0  # the base weights were never pushed
    assert all(torch.equal(base[n], t) for n, t in trainer.named_parameters())  # frozen
    trained = trainer.adapter_tensors()
    assert any(t.abs().max() > 0 for n, t in trained.items() if "lora_B" in n)  # it moved
    # The engine serves the trainer's adapter: its log probs of a sampled answer are the
    # trainer's own, token by token.
    prompt = task.prompt(random.Random(0))
    out = await manager.generate("check", prompt_ids=prompt, adapter="policy",
                                 sampling_params={"max_tokens": 8, "temperature": 1.0})
    assert set(out.global_steps) == {6}
    ids = torch.tensor([[*prompt, *out.token_ids]])
    with torch.no_grad():
        for parameter in trainer.model.parameters():  # as pushed: the adapter goes in bf16
            if parameter.requires_grad:
                parameter.copy_(parameter.to(torch.bfloat16))
        logits = trainer.model(input_ids=ids).logits[0].float().log_softmax(-1)
    mine = [float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    exact = lora_engine.weights.served_dtype == torch.float32  # (a GPU run serves bf16)
    assert mine == pytest.approx(list(out.log_probs), abs=1e-3 if exact else 0.15)
