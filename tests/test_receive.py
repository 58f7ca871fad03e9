"""A worker's receive core (``asyncroll.receive``) on a plain ``torch.nn.Module``, no vLLM: the
check of what a push loaded, fed real pushes through the shared-memory transport, and the
rollback of a failed push with and without a backup."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

import pytest
import torch

from asyncroll import WeightSyncError
from asyncroll.fingerprints import fingerprints
from asyncroll.receive import LoadPlan, PushCheck, Rollback, check_delivered
from asyncroll.transport import ShmBackend, WeightReceiver
from asyncroll.transport.receiver import ReceiveReport
from asyncroll.transport.sender import open_weight_sender


class Tiny(torch.nn.Module):
    """Two layers and a buffer, loaded by name as a model's ``load_weights`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8, bias=False)
        self.register_buffer("scale", torch.ones(8))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        state = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        with torch.no_grad():
            for name, tensor in weights:
                state[name].copy_(tensor)
        return set(state)


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) for n, t in Tiny().state_dict().items()}


async def push_into(
    model: Tiny, pushes: list[dict[str, torch.Tensor]], *, plan: LoadPlan | None = None,
    after_load: object = None,
) -> tuple[PushCheck, list[BaseException | None]]:
    """Push each of ``pushes`` through a real sender into ``model``, checked by a
    ``PushCheck`` the way the vLLM worker checks (fingerprints travel with the push)."""
    check, outcomes = PushCheck(), []
    async with open_weight_sender(backend=ShmBackend(), bucket_bytes=256, receivers=1) as sender:
        receiver = WeightReceiver.from_config(sender.receiver_config(), name="core")
        connected = threading.Event()

        def serve() -> None:
            receiver.connect()
            connected.set()
            for _ in pushes:
                check.begin()
                received: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

                def load(
                    batch: list[tuple[str, torch.Tensor]],
                    received: dict[str, tuple[torch.dtype, tuple[int, ...]]] = received,
                ) -> None:
                    (plan.load if plan is not None else model.load_weights)(batch)
                    received.update((n, (t.dtype, tuple(t.shape))) for n, t in batch)

                if plan is not None:
                    plan.begin_push()
                report = receiver.receive(load)
                if callable(after_load):
                    after_load()
                try:
                    check.verify(model, plan, report, received)
                    outcomes.append(None)
                except WeightSyncError as exc:
                    outcomes.append(exc)

        worker = asyncio.create_task(asyncio.to_thread(serve))
        try:
            for version, tensors in enumerate(pushes):
                await sender.push(tensors, version=version, fingerprints=fingerprints(tensors))
            await worker
        finally:
            if plan is not None:
                plan.forget_sources()
            await asyncio.to_thread(receiver.close)
    return check, outcomes


@pytest.mark.parametrize("planned", [False, True], ids=["loaders", "load-plan"])
async def test_the_check_passes_what_was_pushed_and_names_what_was_not(planned: bool) -> None:
    model = Tiny()
    plan = LoadPlan(model, model.load_weights) if planned else None
    corrupt = False

    def after_load() -> None:  # a load that went wrong where nobody looked
        if corrupt:
            with torch.no_grad():
                model.down.weight.view(-1)[0] += 1.0

    check, outcomes = await push_into(model, [weights(1), weights(2)], plan=plan,
                                      after_load=after_load)
    # Without a plan the buffer is not a parameter: not found whole, so not checkable.
    assert outcomes == [None, None] and check.verified == ((4, 0) if planned else (3, 1))
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in weights(2).items())
    corrupt = True
    _, outcomes = await push_into(model, [weights(3)], plan=plan, after_load=after_load)
    assert isinstance(outcomes[0], WeightSyncError)
    assert "down.weight" in str(outcomes[0]) and "up.weight" not in str(outcomes[0])


def test_a_tensor_changed_after_it_was_fingerprinted_is_named_as_torn() -> None:
    """Tensors the model holds in another form once loaded are checked as they arrived."""
    model, check = Tiny(), PushCheck()
    pushed = weights(4)
    prints = fingerprints(pushed)
    pushed["up.bias"] = pushed["up.bias"] + 1  # changed after its fingerprint was taken
    check.begin()
    check.note_arrived(list(pushed.items()))
    report = ReceiveReport(version=1, push=1, buckets=1, tensors=len(pushed), bytes=0,
                           seconds=0.0, fingerprints=prints)
    received = {"up.bias": (torch.float32, (99,))}  # not found whole in the model
    with pytest.raises(WeightSyncError, match=r"1 tensors arrived other than .*up\.bias"):
        check.verify(model, None, report, received)


def test_a_push_that_loaded_less_than_it_delivered_fails_naming_the_lost() -> None:
    report = ReceiveReport(version=3, push=2, buckets=1, tensors=2, bytes=0, seconds=0.0)
    check_delivered(report, {"a", "b"}, {"a", "b"})
    with pytest.raises(WeightSyncError, match=r"1 of 2 tensors arrived but never reached.*: b"):
        check_delivered(report, {"a", "b"}, {"a"})
    with pytest.raises(WeightSyncError, match="loaded none of them"):
        check_delivered(report, {"a", "b"}, set())


def test_a_failed_direct_push_with_a_backup_restores_every_parameter_and_buffer() -> None:
    model, rollback = Tiny(), Rollback()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    rollback.begin(model, backup=True, direct=True, checkpoint=lambda: None)
    assert rollback.can_roll_back(backup=True, direct=True)
    half = dict(list(weights(5).items())[:2])
    rollback.loading()
    model.load_weights(half.items())
    rollback.loaded(list(half.items()))
    assert rollback.abort(model) is True
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert not rollback.active and not rollback.mixed


def test_a_backup_prepared_ahead_is_what_the_next_update_restores_and_only_that_one() -> None:
    """``prepare`` (a landing thread's, while the model serves) copies the served state ahead
    of the next ``begin``, which then copies nothing: a failed update restores the state as
    it was prepared. An update that commits uses the prepared copy up, so the next ``begin``
    copies the state again (a stale copy would restore weights no longer served)."""
    model, rollback = Tiny(), Rollback()
    prepared = {n: t.clone() for n, t in model.state_dict().items()}
    rollback.prepare(model)
    with torch.no_grad():  # (were ``begin`` to copy, it would back this up instead)
        model.scale.add_(1.0)
    rollback.begin(model, backup=True, direct=True, checkpoint=lambda: None)
    rollback.loading()
    model.load_weights(weights(8).items())
    assert rollback.abort(model) is True
    assert all(torch.equal(t, prepared[n]) for n, t in model.state_dict().items())
    rollback.prepare(model)
    rollback.begin(model, backup=True, direct=True, checkpoint=lambda: None)
    model.load_weights(weights(9).items())
    rollback.loaded(list(weights(9).items()))
    rollback.commit(lambda pending: True)
    served = {n: t.clone() for n, t in model.state_dict().items()}
    assert not torch.equal(served["up.weight"], prepared["up.weight"])
    rollback.begin(model, backup=True, direct=True, checkpoint=lambda: None)  # copies again
    rollback.loading()
    model.load_weights(weights(10).items())
    assert rollback.abort(model) is True
    assert all(torch.equal(t, served[n]) for n, t in model.state_dict().items())


def test_without_a_backup_a_touched_model_is_mixed_until_a_push_lands() -> None:
    model, rollback = Tiny(), Rollback()
    rollback.begin(model, backup=False, direct=True, checkpoint=lambda: None)
    assert not rollback.can_roll_back(backup=False, direct=True)
    assert rollback.abort(model) is True  # nothing touched yet: still whole
    rollback.begin(model, backup=False, direct=True, checkpoint=lambda: None)
    rollback.loading()
    assert rollback.abort(model) is False and rollback.mixed
    assert rollback.abort(model) is False  # asked again: still mixed
    rollback.begin(model, backup=False, direct=True, checkpoint=lambda: None)
    rollback.loaded(list(weights(6).items()))
    rollback.commit(lambda pending: False)
    assert not rollback.mixed and rollback.unknown


def test_a_reprocessing_load_keeps_a_shadow_that_each_push_updates_and_a_failure_reloads(
) -> None:
    """Without direct copies (vLLM's layerwise reload) the backup is a checkpoint-format
    shadow: read once, updated by each landed push, reloaded by the caller on a failure."""
    model, rollback = Tiny(), Rollback()
    checkpoint = weights(7)
    reads, restored, ended = [], [], []

    def read() -> dict[str, torch.Tensor]:
        reads.append(1)
        return dict(checkpoint)

    rollback.begin(model, backup=True, direct=False, checkpoint=read)
    assert rollback.keeps_copies and rollback.shadow is not None
    first = {"up.bias": torch.full((16,), 2.0)}
    rollback.loading()
    rollback.loaded(list(first.items()))
    first["up.bias"].zero_()  # the staging buffer is reused: the shadow kept a copy
    rollback.commit(lambda pending: False)
    assert torch.equal(rollback.shadow["up.bias"], torch.full((16,), 2.0))
    rollback.begin(model, backup=True, direct=False, checkpoint=read)
    rollback.loading()
    assert rollback.abort(
        model, end=lambda: ended.append(1), restore=lambda items: restored.append(dict(items))
    )
    assert reads == [1] and ended == [1]
    assert torch.equal(restored[0]["up.bias"], torch.full((16,), 2.0))
    assert torch.equal(restored[0]["down.weight"], checkpoint["down.weight"])


def test_backups_reuse_their_memory_and_restore_the_weights_of_the_update_before() -> None:
    """The backup of a direct load is copied into the same tensors update after update (no
    allocation per update), and a failure restores what the previous update left, not what
    the first backup saw."""
    model, rollback = Tiny(), Rollback()
    rollback.begin(model, backup=True, direct=True, checkpoint=lambda: None)
    first = {n: t for n, t in rollback._saved.items()}  # the memory kept
    model.load_weights(weights(8).items())  # the first update lands
    rollback.loaded(list(weights(8).items()))
    rollback.commit(lambda pending: False)
    landed = {n: t.clone() for n, t in model.state_dict().items()}
    rollback.begin(model, backup=True, direct=True, checkpoint=lambda: None)
    assert all(rollback._saved[n] is t for n, t in first.items())
    rollback.loading()
    model.load_weights(weights(9).items())  # the second fails midway
    assert rollback.abort(model)
    assert all(torch.equal(t, landed[n]) for n, t in model.state_dict().items())
    rollback.begin(model, backup=False, direct=True, checkpoint=lambda: None)
    assert rollback._saved == {}  # no backup: its memory goes
