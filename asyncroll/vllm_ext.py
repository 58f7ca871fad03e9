"""Inside each vLLM worker: asyncroll's transport as a backend of vLLM's weight-update protocol.

vLLM imports this module in every worker process (it is the ``worker_extension_cls`` module)
before the model loads, so the ``asyncroll`` backend is registered by the time the worker asks
``WeightTransferEngineFactory`` for it. The protocol runs as vLLM defines it:
``init_weight_transfer_engine`` (connect a ``WeightReceiver``), then per update
``start_weight_update`` (layerwise reload, which also works on the CPU build where a plain
``load_weights`` after start-up fails), ``update_weights`` (one whole double-buffered push),
``finish_weight_update``.

Invariants:
- A staging-buffer view never outlives the bucket it came in: tensors that vLLM's layerwise
  loader buffers across a bucket boundary are copied first.
- A push that fails leaves the previous weights in force when a backup was taken (the default
  on CPU), and the model in a consistent state otherwise (the adapter then stops serving it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import layerwise

from asyncroll.transport import WeightReceiver

__all__ = ["BACKEND_NAME", "AsyncrollWeightTransferEngine", "AsyncrollWorkerExtension"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "asyncroll"


@dataclass
class InitInfo(WeightTransferInitInfo):
    address: str
    nonce: str
    secret: str
    timeout_ms: int
    name: str = "engine"
    backup: bool = True
    fail_on: str = ""
    """Test hook: raise while loading the tensor of this name (a receiver-side failure)."""


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    version: int = 0


class AsyncrollWeightTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    """Receives asyncroll pushes and loads them with vLLM's layerwise reload."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receiver: WeightReceiver | None = None
        self._info: InitInfo | None = None
        self._backup: dict[str, torch.Tensor] | None = None

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        self.shutdown()
        rank = self.parallel_config.rank
        self._info = init_info
        self._receiver = WeightReceiver.from_config(
            {
                "address": init_info.address,
                "secret": init_info.secret,
                "nonce": init_info.nonce,
                "timeout_ms": init_info.timeout_ms,
            },
            name=f"{init_info.name}-rank{rank}",
        )
        self._receiver.connect()

    def start_weight_update(self) -> None:
        assert self._info is not None, "init_weight_transfer_engine first"
        self._backup = (
            {name: t.detach().clone() for name, t in _state(self.model).items()}
            if self._info.backup
            else None
        )
        layerwise.initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's version synchronises torch.accelerator, which the CPU build lacks.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: UpdateInfo) -> None:
        assert self._receiver is not None and self._info is not None
        fail_on = self._info.fail_on
        model = self.model

        def load(batch: list[tuple[str, torch.Tensor]]) -> None:
            if fail_on and any(name == fail_on for name, _ in batch):
                raise RuntimeError(f"injected failure loading {fail_on}")
            model.load_weights(batch)  # type: ignore[operator]
            _detach_pending_views()

        try:
            self._receiver.receive(load)
        except BaseException:
            self._roll_back()
            raise

    def finish_weight_update(self) -> None:
        layerwise.finalize_layerwise_reload(  # type: ignore[no-untyped-call]
            self.model, self.model_config
        )
        self._backup = None

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def _roll_back(self) -> None:
        """Put the model back into a consistent state; restore the old weights if backed up."""
        layerwise.finalize_layerwise_reload(  # type: ignore[no-untyped-call]
            self.model, self.model_config
        )
        if self._backup is None:
            logger.error("weight push failed without a backup: the model holds mixed weights")
            return
        state = _state(self.model)
        with torch.no_grad():
            for name, saved in self._backup.items():
                state[name].copy_(saved)
        self._backup = None
        logger.warning("weight push failed: previous weights restored")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _detach_pending_views() -> None:
    """Copy tensors the layerwise loader still holds: they view a staging buffer."""
    for info in list(layerwise.LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor):
                    bound.arguments[key] = value.clone()


class AsyncrollWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); reachable by ``collective_rpc``."""

    def asyncroll_load_serialized(self, payload: bytes) -> int:
        """Baseline for benchmarks: weights as safetensors bytes through vLLM's own RPC."""
        from safetensors.torch import load

        model = self.model_runner.model  # type: ignore[attr-defined]
        tensors = load(payload)
        layerwise.initialize_layerwise_reload(model)
        model.load_weights(list(tensors.items()))
        layerwise.finalize_layerwise_reload(  # type: ignore[no-untyped-call]
            model, self.model_config  # type: ignore[attr-defined]
        )
        return len(tensors)

    def asyncroll_weight_digest(self) -> list[tuple[str, float]]:
        """Per-parameter sums of the served model (tests compare them across engines)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return [(name, float(p.detach().double().sum())) for name, p in model.named_parameters()]


def _register() -> None:
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, AsyncrollWeightTransferEngine)


_register()
