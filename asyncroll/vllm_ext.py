"""Inside each vLLM worker: asyncroll's transport as a backend of vLLM's weight-update protocol.

vLLM imports this module in every worker process (it is the ``worker_extension_cls`` module)
before the model loads, so the ``asyncroll`` backend is registered by the time the worker asks
``WeightTransferEngineFactory`` for it. The protocol runs as vLLM defines it:
``init_weight_transfer_engine`` (connect a ``WeightReceiver``), then per update
``start_weight_update`` (layerwise reload, which also works on the CPU build where a plain
``load_weights`` after start-up fails), ``update_weights`` (one whole double-buffered push),
``finish_weight_update``.

vLLM 0.24 runs the same protocol with the lifecycle in the worker: it starts and finishes the
layerwise reload itself and calls ``receive_weights(info, load_weights=...)``; it builds the
engine without its configs (``asyncroll_bind_weight_transfer_engine`` supplies them) and has no
call to shut the engine down (``asyncroll_shutdown_weight_transfer_engine``). Both are detected
by feature, not by version number.

Invariants:
- A staging-buffer view never outlives the bucket it came in: tensors that vLLM's layerwise
  loader buffers across a bucket boundary are copied first.
- A push that fails leaves the previous weights in force when a backup was taken (the default
  on CPU), and the model in a consistent state otherwise (the adapter then admits no request
  until a push succeeds: see ``asyncroll.weights``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
from asyncroll.transport.receiver import ReceiveReport

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
    load: str = "layerwise"
    """``layerwise``: vLLM's layerwise reload (portable; the CPU build needs it, since it repacks
    weights for its kernels). ``direct``: ``model.load_weights`` into the served parameters in
    place, as verl and slime do on GPU; several times faster, for unquantized models on GPU."""
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
        # vLLM 0.24 passes (config, parallel_config, model) only; the worker binds the rest.
        self.model_config: Any = getattr(self, "model_config", None)
        self.device: Any = getattr(self, "device", None)
        self._receiver: WeightReceiver | None = None
        self.last_report: ReceiveReport | None = None
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

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Abstract in vLLM 0.24; asyncroll's trainer side is ``asyncroll.WeightPusher``."""
        raise NotImplementedError("asyncroll pushes with asyncroll.weights.WeightPusher")

    @property
    def direct(self) -> bool:
        return self._info is not None and self._info.load == "direct"

    def start_weight_update(self) -> None:
        assert self._info is not None, "init_weight_transfer_engine first"
        self._backup = _clone_state(self.model) if self._info.backup else None
        if not self.direct:
            layerwise.initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's version synchronises torch.accelerator, which the CPU build lacks.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(
        self,
        update_info: UpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
    ) -> None:
        """Receive one push. ``load_weights`` is given by vLLM 0.24, whose worker has already
        started the layerwise reload (and will finish it) around this call, or, for a
        ``direct`` load (``start_weight_update(is_checkpoint_format=False)``), started nothing:
        its loader copies kernel-format names, so the model's own loader is used instead."""
        assert self._receiver is not None and self._info is not None
        fail_on = self._info.fail_on
        worker_driven = load_weights is not None
        direct = self.direct
        load_batch: Callable[[list[tuple[str, torch.Tensor]]], Any] = (
            self.model.load_weights  # type: ignore[assignment]
            if direct or load_weights is None
            else load_weights
        )
        if worker_driven and self._info.backup:
            self._backup = (
                _clone_state(self.model) if direct else _backup_from_layerwise(self.model)
            )

        def load(batch: list[tuple[str, torch.Tensor]]) -> None:
            if fail_on and any(name == fail_on for name, _ in batch):
                raise RuntimeError(f"injected failure loading {fail_on}")
            load_batch(batch)
            if not direct:
                _detach_pending_views()

        try:
            self.last_report = self._receiver.receive(load)
        except BaseException:
            self._roll_back()
            raise
        if worker_driven:
            self._backup = None  # 0.24 never calls finish_weight_update on the engine

    def finish_weight_update(self) -> None:
        if not self.direct:
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
        if not self.direct:
            layerwise.finalize_layerwise_reload(  # type: ignore[no-untyped-call]
                self.model, self.model_config
            )
        if self._backup is None:
            logger.error("weight push failed without a backup: the model holds mixed weights")
            return
        state = _state(self.model)
        with torch.no_grad():
            for name, saved in self._backup.items():
                if name in state:  # aliases (tied weights) appear once in the state
                    state[name].copy_(saved)
        self._backup = None
        logger.warning("weight push failed: previous weights restored")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in _state(model).items()}


def _backup_from_layerwise(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the served (kernel-format) tensors once the layerwise reload has started: the
    parameters are placeholders then, and the reload keeps the served tensors aside."""
    backup: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is None or info.kernel_tensors is None:
            continue
        parameters, buffers = info.kernel_tensors
        for name, tensor in {**parameters, **buffers}.items():
            backup[f"{module_name}.{name}" if module_name else name] = tensor.detach().clone()
    return backup


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

    def asyncroll_bind_weight_transfer_engine(self) -> None:
        """Give the weight-transfer engine the configs vLLM 0.24 builds it without."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and getattr(engine, "model_config", None) is None:
            engine.model_config = self.model_config  # type: ignore[attr-defined]
            engine.device = self.device  # type: ignore[attr-defined]

    def asyncroll_shutdown_weight_transfer_engine(self) -> None:
        """Release the receiver's mappings (vLLM 0.24 has no call for it)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.shutdown()

    def asyncroll_last_receive_report(self) -> dict[str, float] | None:
        """The worker's view of the last push: seconds in all, seconds loading (benchmarks)."""
        engine = getattr(self, "weight_transfer_engine", None)
        report = getattr(engine, "last_report", None)
        if report is None:
            return None
        return {"seconds": report.seconds, "load_seconds": report.load_seconds}

    def asyncroll_weight_digest(self) -> list[tuple[str, float]]:
        """Per-parameter sums of the served model (tests compare them across engines)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return [(name, float(p.detach().double().sum())) for name, p in model.named_parameters()]


def _register() -> None:
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, AsyncrollWeightTransferEngine)


_register()
