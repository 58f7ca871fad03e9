"""A trainer of two ranks (FSDP2 ``fully_shard`` on gloo, two processes, the shared-memory
transport) pushing into a tensor-parallel vLLM CPU engine (TP=2) that rank 0 holds: each rank
gathers the full tensors bucket by bucket and serves the worker of its own rank
(``asyncroll.DistributedWeightPusher``). The ranks run ``tests/distributed_scenario.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import free_port, selected_tests

pytestmark = pytest.mark.engine  # the ranks start the engines

SCENARIO = Path(__file__).resolve().parent / "distributed_scenario.py"
ROOT = str(Path(__file__).resolve().parent.parent)
HANG_GUARD_S = 900
"""Only against a hang (a test that never ends); nothing here is timed."""


async def run_ranks(
    folder: Path, model_a: Path, model_b: Path, *, die_rank: int, engines: int = 1,
    family: str = "qwen2",
) -> tuple[list[int | None], str]:
    """Both ranks of the scenario; their exit codes, and the log of the one that survives."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    logs = [open(folder / f"rank{rank}.log", "w") for rank in (0, 1)]  # noqa: ASYNC230
    ranks = [
        await asyncio.create_subprocess_exec(
            sys.executable, str(SCENARIO), "--rank", str(rank), "--port", str(port),
            "--model-a", str(model_a), "--model-b", str(model_b), "--die-rank", str(die_rank),
            "--out", str(folder / f"rank{rank}.json"), "--timeout", "120",
            "--engines", str(engines), "--family", family,
            stdout=logs[rank], stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            codes = [await rank.wait() for rank in ranks]
    finally:
        for file in logs:
            file.close()
        for rank in ranks:
            if rank.returncode is None:
                rank.kill()
                await rank.wait()
            # A rank that dies (os._exit) leaves its engine's processes behind, as a crashed
            # trainer would: vLLM's engine core does not watch its parent. End them all.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank.pid, signal.SIGKILL)
    survivor = 1 - die_rank if die_rank in (0, 1) else 0
    return codes, (folder / f"rank{survivor}.log").read_text()[-3000:]


async def run_example(folder: Path) -> tuple[int | None, str]:
    """``examples/fsdp_hybrid.py`` under torchrun for two steps; its exit code and output."""
    example = Path(ROOT) / "examples" / "fsdp_hybrid.py"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "--log-dir", str(folder / "logs"), str(example),
        "--steps", "2",
        "--plot", str(folder / "fsdp.png"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ROOT},
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            output, _ = await process.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever a failed run left behind
    return process.returncode, output.decode(errors="replace")


RUN_OF_TEST = {
    "test_every_parameter_is_sharded_and_gathers_exactly": "sharded",
    "test_pushes_from_two_ranks_are_token_exact": "sharded",
    "test_a_piece_a_worker_cannot_load_is_pushed_again_whole": "sharded",
    "test_a_rank_dying_mid_push_fails_the_update_and_the_engine_rolls_back": "sharded",
    "test_split_each_rank_feeds_its_own_worker_of_a_tp2_engine_token_exact": "sharded",
    "test_fan_in_every_rank_sends_its_own_rows_to_every_worker_token_exact": "sharded",
    "test_the_staged_pusher_attaches_again_after_the_push_groups": "sharded",
    "test_two_ranks_push_into_two_data_parallel_engines": "data_parallel",
    "test_split_two_ranks_feed_two_engines_each_its_own_token_exact": "data_parallel",
    "test_the_coordinator_dying_mid_push_fails_the_update_on_the_other_rank": "data_parallel",
    "test_the_fsdp_hybrid_example_trains_and_pushes_from_two_ranks": "fsdp_hybrid",
    "test_fused_experts_sharded_over_two_ranks_push_token_exact": "fused_experts",
}
"""The run each test reads: the scenario's three (``distributed_scenario.py``), and the example.
The data-parallel pushes and the coordinator's death share one run: a run's start-up (two
ranks, the engines) is most of its time."""

AT_ONCE = 2
"""Runs under way together. Their engines' starts wait on one process after another far more than
they compute, so two runs take little longer than one on the two-core machine; each run holds a
trainer's two ranks and a TP=2 engine (or two engines of one worker), so two fit in memory."""


class Runs:
    """The module's runs, started in the background (``AT_ONCE`` at a time, in the order the
    tests read them) once the first test asks for one; each test awaits the one it reads. Only
    the runs of the selected tests start."""

    def __init__(self, folder: Path, model_a: Path, model_b: Path, wanted: list[str]) -> None:
        self._folder, self._models = folder, (model_a, model_b)
        self._wanted = wanted
        self._slots = asyncio.Semaphore(AT_ONCE)
        self._tasks: dict[str, asyncio.Task[tuple[list[int | None], str, Path]]] = {}

    async def result(self, name: str) -> tuple[list[int | None], str, Path]:
        """The exit codes of ``name``'s processes, the log of the one that survives, and the
        folder of its files."""
        for wanted in (*self._wanted, name):
            if wanted not in self._tasks:
                self._tasks[wanted] = asyncio.create_task(self._run(wanted))
        return await self._tasks[name]

    async def _run(self, name: str) -> tuple[list[int | None], str, Path]:
        folder = self._folder / name
        folder.mkdir()
        async with self._slots:
            if name == "fsdp_hybrid":
                code, text = await run_example(folder)
                return [code], text, folder
            if name == "fused_experts":
                codes, log = await run_ranks(folder, *self._models, die_rank=-1, family="mixtral")
                return codes, log, folder
            die_rank, engines = {"sharded": (1, 1), "data_parallel": (0, 2)}[name]
            codes, log = await run_ranks(folder, *self._models, die_rank=die_rank, engines=engines)
            return codes, log, folder

    async def aclose(self) -> None:
        for task in self._tasks.values():
            task.cancel()  # a run cancelled ends its processes (run_ranks, run_example)
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


@pytest.fixture(scope="module")
async def runs(
    request: pytest.FixtureRequest, tiny_model_a: Path, tiny_model_b: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Runs]:
    wanted = sorted(
        {RUN_OF_TEST[test] for test in selected_tests(request)},
        key=list(RUN_OF_TEST.values()).index,
    )
    runs = Runs(tmp_path_factory.mktemp("distributed"), tiny_model_a, tiny_model_b, wanted)
    try:
        yield runs
    finally:
        await runs.aclose()


@pytest.fixture(scope="module")
async def outcome(runs: Runs) -> dict[str, Any]:
    codes, log, folder = await runs.result("sharded")
    assert codes == [0, 17], f"exit codes {codes} (rank 1 exits 17 where it dies); rank 0:\n{log}"
    result: dict[str, Any] = json.loads((folder / "rank0.json").read_text())
    return result


def test_every_parameter_is_sharded_and_gathers_exactly(outcome: dict[str, Any]) -> None:
    assert outcome["sharded"]  # every parameter a DTensor: each rank holds half
    assert outcome["gathers_match"]  # our one-call gather equals DTensor.full_tensor()
    # Each rank's column block of every 2-D parameter (the row-parallel exchange: alone, one
    # all-to-all; batched, sends and receives) equals the full tensor's columns.
    assert outcome["blocks_differ"] == []


def test_pushes_from_two_ranks_are_token_exact(outcome: dict[str, Any]) -> None:
    """A then B then A: B's outputs equal the engine's own when it was fresh on B, token for
    token; A's differ from them and come back the same the second time."""
    assert outcome["on_b"] == outcome["fresh_b"]
    assert outcome["on_a"] != outcome["fresh_b"]
    assert outcome["on_a_again"] == outcome["on_a"]
    # The second A had two tensors in layouts no piece maps, pushed whole (gathered): the
    # head on a 2-D mesh, the embedding sharded by columns (issue 44's bad input).
    assert outcome["other_layouts"] == {
        "lm_head.weight": [[1, 2], ["R", "S(0)"]],
        "model.embed_tokens.weight": [[2], ["S(1)"]],
    }
    for tag, steps in (("a", 1), ("b", 2), ("a_again", 3)):
        assert outcome[f"report_{tag}"] == [steps, 27, True]
        workers, tensors, verified = outcome[f"delivery_{tag}"]
        assert (workers, tensors) == (2, 2 * 27)  # each worker took every tensor from its rank
        assert verified > 0  # checked against fingerprints of the gathered tensors


def test_a_piece_a_worker_cannot_load_is_pushed_again_whole(outcome: dict[str, Any]) -> None:
    """The coordinator has two tensors pushed as pieces (q_proj as each rank's rows, o_proj as
    the column blocks the ranks exchange, in one batch) that the workers cannot load (no
    load plan): they refuse them (``PieceNotPlannedError``), the coordinator's verdict tells
    every rank, and both push whole tensors in the same update, which lands."""
    assert outcome["exchanges"] == 1  # o_proj's blocks, exchanged as its bucket was packed
    assert outcome["retried"] == [4, [], {}]  # the update's last push carried no pieces
    assert outcome["on_b_retried"] == outcome["fresh_b"]


def test_a_rank_dying_mid_push_fails_the_update_and_the_engine_rolls_back(
    outcome: dict[str, Any],
) -> None:
    """Rank 1 exits inside a gather of a push of B: rank 0 gets ``WeightSyncError`` (long
    before its 120 s deadline: it hears of the death from gloo and from its workers), and the
    engine keeps serving A under A's label."""
    assert outcome["died"].startswith("WeightSyncError: weight push (global_steps=10) failed")
    assert "every engine serves its previous weights" in outcome["died"]
    assert outcome["died_after_s"] < 120
    assert outcome["steps_after"] == 9 and not outcome["dead"]
    assert outcome["after_death"] == outcome["on_a"] != outcome["fresh_b"]  # not B


def test_the_staged_pusher_attaches_again_after_the_push_groups(outcome: dict[str, Any]) -> None:
    """After the split and fan-in pushers had the engine, the staged pusher attaches it again
    (each rank a new sender, each worker its rank's) and its push lands: the engine serves A
    under its label. (Its channel once closed its old sender by detaching the engine it had
    just attached again: the receivers left as they came, and a rank that had not yet seen
    its worker ready waited for it until the deadline.)"""
    assert outcome["back_report"] == [9, 27]
    assert outcome["back_steps"] == 9
    assert outcome["back_on_a"] == outcome["on_a"]


async def test_split_each_rank_feeds_its_own_worker_of_a_tp2_engine_token_exact(
    runs: Runs, outcome: dict[str, Any],
) -> None:
    """The split layout's transport (``backend="broadcast"``): each rank forms a push group of
    its own with the worker it serves (worker ``i`` joins rank ``i % 2``'s group) and sends it
    the tensors, gathered where they are sharded; neither rank sends the other's worker
    anything. A then B serve what the staged pushes of A served, and B as a fresh engine on B,
    token for token, checked against fingerprints of the shards."""
    assert outcome["split_on_b"] == [outcome["fresh_b"]]
    assert outcome["split_on_a"] == [outcome["on_a"]]
    for tag, steps in (("a", 5), ("b", 6)):
        assert outcome[f"split_steps_{tag}"] == [steps]
        (workers, tensors, verified), = outcome[f"split_delivery_{tag}"]
        assert (workers, tensors) == (2, 2 * 27) and verified > 0
    _, _, folder = await runs.result("sharded")
    other = json.loads((folder / "rank1.json").read_text())  # (written before it died)
    for found in (outcome, other):  # each rank: its own group, one receiver, every tensor
        assert found["split_sent_a"][:3] == found["split_sent_b"][:3] == ["BroadcastSender", 1, 27]


async def test_fan_in_every_rank_sends_its_own_rows_to_every_worker_token_exact(
    runs: Runs, outcome: dict[str, Any],
) -> None:
    """``fan_in``: both workers of the TP=2 engine join both ranks' push groups; each rank
    sends only its own rows of every sharded tensor (every parameter here), no gather, to both
    workers at once; the workers put the rows together (the CPU build loads whole tensors)
    and serve A, then B, token for token as before, checked against the shards' prints."""
    assert outcome["fan_in_on_a"] == [outcome["on_a"]]
    assert outcome["fan_in_on_b"] == [outcome["fresh_b"]]
    _, _, folder = await runs.result("sharded")
    other = json.loads((folder / "rank1.json").read_text())
    for tag, steps in (("a", 7), ("b", 8)):
        assert outcome[f"fan_in_steps_{tag}"] == [steps]
        (workers, tensors, verified), = outcome[f"fan_in_delivery_{tag}"]
        assert (workers, tensors) == (2, 2 * 2 * 27) and verified > 0  # 27 pieces from each
        assert len(outcome[f"fan_in_pieces_{tag}"]) == 27  # every tensor: each rank's rows
        for found in (outcome, other):  # two receivers each, half of every tensor
            kind, receivers, tensors, sent = found[f"fan_in_sent_{tag}"]
            assert (kind, receivers, tensors) == ("BroadcastSender", 2, 27)
            whole = outcome[f"split_sent_{tag}"][3]  # (bytes sent: buckets padded to 256 B)
            assert abs(sent * 2 - whole) < 0.01 * whole  # half the bytes of a gathered push


async def test_split_two_ranks_feed_two_engines_each_its_own_token_exact(runs: Runs) -> None:
    """Two engines of one worker each, fed by two ranks through push groups of their own
    (rank ``i`` to engine ``i``: one group per engine, the engines fed in parallel, no rank
    serving both): both serve A as the staged push served it, then B as a fresh engine."""
    codes, log, folder = await runs.result("data_parallel")
    assert codes == [17, 0], f"exit codes {codes} (rank 0 exits 17 where it dies); rank 1:\n{log}"
    found = json.loads((folder / "rank0.json").read_text())
    assert found["split_on_a"] == found["on_a"]
    assert found["split_on_b"] == found["fresh_b"]
    for tag, steps in (("a", 3), ("b", 4)):
        assert found[f"split_steps_{tag}"] == [steps, steps]
        for workers, tensors, verified in found[f"split_delivery_{tag}"]:
            assert (workers, tensors) == (1, 27) and verified > 0
    other = json.loads((folder / "rank1.json").read_text())
    for rank in (found, other):
        assert rank["split_sent_a"][:3] == rank["split_sent_b"][:3] == ["BroadcastSender", 1, 27]
    # fan_in: each rank sends its own rows of every tensor to both engines at once (one
    # broadcast to two receivers), no gather; both engines serve A, then B, as before.
    assert found["fan_in_on_a"] == found["on_a"] and found["fan_in_on_b"] == found["fresh_b"]
    for tag, steps in (("a", 5), ("b", 6)):
        assert found[f"fan_in_steps_{tag}"] == [steps, steps]
        for workers, tensors, verified in found[f"fan_in_delivery_{tag}"]:
            assert (workers, tensors) == (1, 2 * 27) and verified > 0  # rows from each rank
        for rank in (found, other):
            assert rank[f"fan_in_sent_{tag}"][:3] == ["BroadcastSender", 2, 27]
    # Then engine 0 alone: rank 1 serves no worker (no group, nothing sent) and makes its part
    # of rank 0's gathers while rank 0 pushes.
    assert found["lone_on_a"] == found["on_a"][0]
    assert found["lone_steps"] == [7, 6]
    assert (found["lone_receivers"], other["lone_receivers"]) == (1, None)


async def test_two_ranks_push_into_two_data_parallel_engines(runs: Runs) -> None:
    """Two engines of one worker each on rank 0: worker ``i`` is served by rank ``i % 2``, so
    each rank's sender feeds one worker; both engines take every tensor, label each update,
    and serve A, then B token for token as a fresh engine on B does. (Rank 0 dies after, in
    the next test's push: it wrote this first.)"""
    codes, log, folder = await runs.result("data_parallel")
    assert codes == [17, 0], f"exit codes {codes} (rank 0 exits 17 where it dies); rank 1:\n{log}"
    found = json.loads((folder / "rank0.json").read_text())
    fresh_b = found["fresh_b"]
    assert fresh_b[0] == fresh_b[1]
    assert found["on_a"][0] == found["on_a"][1] != fresh_b[0]
    assert found["on_b"] == fresh_b
    for tag, steps in (("a", 1), ("b", 2)):
        assert found[f"delivery_{tag}"] == [[1, 27], [1, 27]]
        assert found[f"steps_{tag}"] == [steps, steps]
        assert found[f"receivers_{tag}"] == 1  # rank 0 fed one of the two workers
    other = json.loads((folder / "rank1.json").read_text())
    assert other["receivers_a"] == other["receivers_b"] == 1  # and rank 1 the other


async def test_the_coordinator_dying_mid_push_fails_the_update_on_the_other_rank(
    runs: Runs,
) -> None:
    """After the data-parallel pushes, rank 0 (the engines' process) exits inside a gather of
    a split push into engine 0 alone (rank 1 serves no worker, it makes gathers): rank 1 gets
    ``WeightSyncError`` long before its 120 s deadline (its gathers fail, and the
    coordinator's verdict never comes), and ends."""
    codes, log, folder = await runs.result("data_parallel")
    assert codes == [17, 0], f"exit codes {codes} (rank 0 exits 17 where it dies); rank 1:\n{log}"
    found = json.loads((folder / "rank1.json").read_text())
    assert found["died"].startswith("WeightSyncError"), found["died"]
    assert found["died_after_s"] < 120


async def test_the_fsdp_hybrid_example_trains_and_pushes_from_two_ranks(runs: Runs) -> None:
    """``examples/fsdp_hybrid.py`` under torchrun: two FSDP2 ranks train while the TP=2 engine
    sleeps, then push through the manager (rank 0) and the pusher (rank 1)."""
    (code,), text, folder = await runs.result("fsdp_hybrid")
    assert code == 0, text[-3000:]
    for step in (1, 2):
        assert f"step {step}: reward" in text and "from 2 ranks" in text, text[-3000:]
    assert (folder / "fsdp.png").stat().st_size > 0


async def test_fused_experts_sharded_over_two_ranks_push_token_exact(runs: Runs) -> None:
    """A transformers-5 Mixtral on two FSDP2 ranks: its experts fused (``mlp.experts.down_proj``,
    experts x hidden x width) and sharded over the experts, its router under ``mlp.gate``.
    Pushed under the checkpoint's names (``block_sparse_moe.experts.N.w1``, ...: the coordinator
    decides, the other rank follows), each expert gathered from the rank that holds it: the
    TP=2 engine started on seed 1 serves seed 0's tokens, then its own fresh ones again."""
    codes, log, folder = await runs.result("fused_experts")
    assert codes == [0, 0], f"exit codes {codes}; rank 0:\n{log}"
    found = json.loads((folder / "rank0.json").read_text())
    assert found["fused"] == ["model.layers.0.mlp.experts.down_proj"]
    assert found["fused_shard"] == [[4, 128, 64]]  # four of the eight experts on each rank
    assert found["on_0"] != found["fresh_1"]
    assert found["on_1"] == found["fresh_1"]
    for seed, steps in ((0, 1), (1, 2)):
        steps_, tensors = found[f"report_{seed}"]
        assert steps_ == steps and tensors > 3 * 8  # every expert's three projections, at least
        workers, delivered, verified = found[f"delivery_{seed}"]
        assert workers == 2 and delivered == 2 * tensors
        assert verified > 0  # against fingerprints taken from the ranks' shards

