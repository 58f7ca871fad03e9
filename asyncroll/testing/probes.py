"""Worker RPCs for tests and benchmarks only, kept out of the production worker.

``ProbingExtension`` is asyncroll's worker extension plus RPCs that read what a worker holds
or how long its work took: the served weights' digest and hash, the worker's full report of
the last push, step times, a bare round trip, and vLLM's own RPC path as a baseline. Launch an
engine with it to call them (``engine.collective_rpc("asyncroll_weight_hash")``)::

    engine = await VLLMEngine.start(path, worker_extension_cls=PROBES_EXTENSION)

``asyncroll.testing.faults.FaultInjectingExtension`` builds on it (the test suite's engines).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncroll.vllm.worker import (
    AsyncrollWeightTransferEngine,
    AsyncrollWorkerExtension,
    SampleCounter,
    delivery_of,
    reload_weights,
)

__all__ = ["PROBES_EXTENSION", "ProbingExtension"]

PROBES_EXTENSION = "asyncroll.testing.probes.ProbingExtension"
"""Pass as ``worker_extension_cls`` when launching an engine whose workers a test or a
benchmark probes."""


class ProbingExtension(AsyncrollWorkerExtension):
    """asyncroll's worker extension plus the probing RPCs (see the module doc)."""

    def asyncroll_last_receive_report(self) -> dict[str, Any] | None:
        """The worker's view of the last push: seconds in all and by stage (waiting for the
        sender, loading, marking reads done, acking, the final device sync), and what the load
        plan did (benchmarks)."""
        engine = getattr(self, "weight_transfer_engine", None)
        report = getattr(engine, "last_report", None)
        delivered = delivery_of(engine)
        if engine is None or report is None or delivered is None:
            return None
        out: dict[str, Any] = {
            **delivered,
            "verify_seconds": engine.check.seconds,
            "early_reads": engine.check.early_reads,
            "seconds": report.seconds,
            "load_seconds": report.load_seconds,
            "wait_seconds": report.wait_seconds,
            "record_seconds": report.record_seconds,
            "ack_seconds": report.ack_seconds,
            "sync_seconds": report.sync_seconds,
            "timeline": [dataclasses.asdict(times) for times in report.timeline],
            "began": report.began,
            "entered": getattr(engine, "entered", report.began),
            "called": getattr(engine, "called", 0.0),
            "returned": getattr(engine, "returned", 0.0),
            "stamps": dict(getattr(engine, "stamps", {})),
        }
        stats = (
            engine.plan_statistics
            if isinstance(engine, AsyncrollWeightTransferEngine)
            else None
        )
        if stats is not None:
            out |= {
                "planned": stats.planned,
                "learned": stats.learned,
                "fallback": stats.fallback,
                "copies": stats.copies,
                "calls": stats.calls,
                "remembered": stats.remembered,
                "invalidations": stats.invalidations,
                "plan_check_seconds": stats.check_seconds,
                "unplannable": dict(list(stats.unplannable.items())[:8]),
            }
        return out

    def asyncroll_weight_digest(self) -> list[tuple[str, float]]:
        """Per-parameter sums of the served model (tests compare them across engines)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return [(name, float(p.detach().double().sum())) for name, p in model.named_parameters()]

    def asyncroll_parameter_shapes(self) -> dict[str, list[int]]:
        """Each served parameter's shape on this worker (what a tensor-parallel or expert-
        parallel worker holds of it)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return {name: list(p.shape) for name, p in model.named_parameters()}

    def asyncroll_weight_checksums(self, names: list[str]) -> dict[str, float]:
        """A position-weighted sum of each named parameter (``position_checksum``): unlike a
        plain sum, it changes when rows move (two experts swapped, gate and up crossed)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        params = dict(model.named_parameters())
        return {name: position_checksum(params[name]) for name in names}

    def asyncroll_weight_hash(self) -> str:
        """One hash of every parameter's bytes, in name order (bitwise comparisons in tests)."""
        import hashlib

        digest = hashlib.blake2b(digest_size=16)
        model = self.model_runner.model  # type: ignore[attr-defined]
        for name, p in sorted(model.named_parameters()):
            digest.update(name.encode())
            digest.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().data)
        return digest.hexdigest()

    def asyncroll_lora_slot_digest(self, revision: int) -> str | None:
        """One hash of what every LoRA layer holds in ``revision``'s device slot (None: it
        holds none): bitwise comparisons of two ways of writing a slot."""
        import hashlib

        adapters = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        if revision not in adapters.lora_index_to_id:
            return None
        index = adapters.lora_index_to_id.index(revision)
        digest = hashlib.blake2b(digest_size=16)
        for name, module in sorted(adapters.modules.items()):
            for stacked in (*module.lora_a_stacked, *module.lora_b_stacked):
                digest.update(name.encode())
                digest.update(stacked[index].contiguous().view(-1).view(torch.uint8).cpu().numpy().data)
        return digest.hexdigest()

    def asyncroll_adapter_memory(self) -> dict[str, Any]:
        """The landings the worker made for adapter revisions, and where each held revision's
        chunks lie (``RevisionStore.memory``)."""
        from asyncroll.vllm.lora import store_of

        store = store_of(self)
        assert store is not None, "LoRA is off"
        return {"landings": store.landings_made, "held": store.memory()}

    def asyncroll_lora_deactivate(self, revision: int) -> bool:
        """Take ``revision`` out of its device slot, as vLLM does when a step needs the slot
        for another LoRA; it stays registered, and a step that names it activates it again."""
        adapters = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        return bool(adapters.deactivate_adapter(revision))

    def asyncroll_forget_adapter_layouts(self) -> None:
        """Forget the adapter layouts this worker keeps (as a restarted worker would)."""
        self.__dict__.pop("_asyncroll_layouts", None)

    def asyncroll_hold_steps(self, port: int, timeout: float = 120.0) -> bool:
        """Hold this worker's step loop (the RPC runs between two steps) until told to go:
        connect to ``port`` on this host, say ``held``, and wait for its ``go`` (at most
        ``timeout`` seconds). Tests: what must happen while the engine takes no step."""
        import socket

        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
            conn.sendall(b"held")
            return conn.recv(2) == b"go"

    def asyncroll_ping(self) -> None:
        """Nothing: one round trip through vLLM's RPC (benchmarks measure the floor that the
        update's two RPCs, the receive and the finish, set under its time)."""

    def asyncroll_step_times(self, since: float = 0.0) -> list[float]:
        """When the model's recent steps began, from ``since`` on (``SampleCounter.started``;
        benchmarks: the longest gap around an update is the engine's stall)."""
        counter: SampleCounter | None = getattr(self, "_asyncroll_samples", None)
        return [] if counter is None else [t for t in counter.started if t >= since]

    def asyncroll_step_spans(self, since: float = 0.0) -> list[tuple[float, float]]:
        """Each recent step's start and end (its forward pass and its sampling), from
        ``since`` on (``SampleCounter.spans``): what a gap between two steps holds besides
        the steps themselves."""
        counter: SampleCounter | None = getattr(self, "_asyncroll_samples", None)
        return [] if counter is None else [(a, b) for a, b in counter.spans if a >= since]

    def asyncroll_drop_load_plan(self) -> None:
        """Forget the load plan (the next push learns it again, through ``load_weights``):
        after the model's parameters were replaced outside a push, say."""
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, AsyncrollWeightTransferEngine):
            engine.drop_plan()

    def asyncroll_load_serialized(self, payload: bytes) -> int:
        """Baseline for benchmarks: weights as safetensors bytes through vLLM's own RPC."""
        from safetensors.torch import load

        tensors = load(payload)
        reload_weights(self.model_runner.model, self.model_config, tensors.items())  # type: ignore[attr-defined]
        return len(tensors)


def position_checksum(tensor: torch.Tensor) -> float:
    """``sum(x[i] * (1 + i / n))`` over the flattened tensor, in float64."""
    flat = tensor.detach().reshape(-1)
    total, step, n = torch.zeros((), dtype=torch.float64, device=flat.device), 1 << 24, flat.numel()
    for start in range(0, n, step):  # in slices: a float64 copy of an expert stack is GiBs
        part = flat[start:start + step].double()
        weights = torch.arange(start, start + part.numel(), dtype=torch.float64, device=flat.device)
        total += (part * (1 + weights / n)).sum()
    return float(total)
