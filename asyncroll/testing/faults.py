"""Failures injected into a real vLLM engine's workers, for tests and benchmarks only.

Launch the engine with this module's worker extension, then inject around the code under test::

    engine = await VLLMEngine.start(path, worker_extension_cls=FAULTS_EXTENSION)
    async with inject_fault(engine, "load", tensor="model.layers.1.mlp.down_proj.weight"):
        with pytest.raises(WeightSyncError):
            await pusher.update(...)

Points: ``load`` (the worker raises before handing the batch holding ``tensor`` to the model's
loader: a receiver-side failure), ``after_load`` (it raises once every tensor is loaded, before
the push is acknowledged: the weights are new, the update failed), ``skip`` (the worker hands
``tensor``, or with no tensor every tensor, to nobody: a loader that silently skips names).
Production code carries no hook of its own; this extension overrides the transfer engine's
``before_load``, ``to_load`` and ``after_load`` extension points on the live instance. And
``corrupt``: once every tensor is loaded, the worker changes the first element of parameter
``tensor`` (a load that went wrong where nobody looked: the fingerprints must see it). And
``register``: the worker's next adapter registration fails inside vLLM's part of it, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Literal

import torch

from asyncroll.testing.probes import ProbingExtension
from asyncroll.vllm.lora import RevisionStore, store_of

__all__ = ["FAULTS_EXTENSION", "FaultInjectingExtension", "FaultPoint", "inject_fault"]

FAULTS_EXTENSION = "asyncroll.testing.faults.FaultInjectingExtension"
"""Pass as ``worker_extension_cls`` when launching an engine that tests inject faults into."""

FaultPoint = Literal["load", "after_load", "skip", "corrupt", "register"]


class FaultInjectingExtension(ProbingExtension):
    """asyncroll's worker extension, its probes (``asyncroll.testing.probes``), and one RPC
    that arms or clears a fault."""

    def asyncroll_inject_fault(self, point: str, tensor: str = "", rank: int | None = None
                               ) -> None:
        """Arm ``point`` (``load`` with a tensor name, or ``after_load``) in this worker, or
        only if its rank is ``rank``; an empty ``point`` clears every fault."""
        engine: Any = self.weight_transfer_engine  # type: ignore[attr-defined]
        for point_name in ("before_load", "to_load", "after_load"):
            engine.__dict__.pop(point_name, None)
        store = store_of(self)
        if store is not None:
            store.__dict__.pop("_add", None)
        if rank is not None and self.parallel_config.rank != rank:  # type: ignore[attr-defined]
            return
        if point == "load":
            if not tensor:
                raise ValueError("a load fault needs the tensor name to fail on")
            engine.before_load = _fail_loading(tensor)
        elif point == "after_load":
            engine.after_load = _fail_after_load
        elif point == "skip":
            engine.to_load = _skipping(tensor)
        elif point == "corrupt":
            if not tensor:
                raise ValueError("a corrupt fault needs the parameter to corrupt")
            engine.after_load = _corrupting(engine, tensor)
        elif point == "register":
            if store is None:
                raise ValueError("a register fault needs an engine with LoRA")
            store._add = _failing_once(store)  # type: ignore[method-assign]
        elif point:
            raise ValueError(f"unknown fault point {point!r}")


@contextlib.asynccontextmanager
async def inject_fault(
    engine: Any, point: FaultPoint, *, tensor: str = "", rank: int | None = None
) -> AsyncIterator[None]:
    """Arm a fault in every worker of ``engine`` (a ``VLLMEngine`` launched with
    ``FAULTS_EXTENSION``), or only in the worker of rank ``rank`` (tensor parallel), for the
    body of the ``async with``; cleared on exit."""
    # Through ``call_vllm``: a call into an engine whose core died fails, not hangs.
    await engine.collective_rpc("asyncroll_inject_fault", args=(point, tensor, rank))
    try:
        yield
    finally:
        if not engine.is_dead:
            await engine.collective_rpc("asyncroll_inject_fault", args=("", ""))


def _fail_loading(tensor: str) -> Any:
    def before_load(batch: list[tuple[str, torch.Tensor]]) -> None:
        if any(name == tensor for name, _ in batch):
            raise RuntimeError(f"injected failure loading {tensor}")

    return before_load


def _skipping(tensor: str) -> Any:
    def to_load(batch: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return [(name, t) for name, t in batch if tensor and name != tensor]

    return to_load


def _corrupting(engine: Any, tensor: str) -> Any:
    def after_load() -> None:
        parameter = engine.model.get_parameter(tensor)
        with torch.no_grad():
            parameter.view(-1)[0] += 1

    return after_load


def _fail_after_load() -> None:
    raise RuntimeError("injected failure after every tensor was loaded")


def _failing_once(store: RevisionStore) -> Any:
    def failing(*args: Any, **kwargs: Any) -> str:
        del store.__dict__["_add"]  # once
        raise RuntimeError("injected fault: the registration failed")

    return failing
