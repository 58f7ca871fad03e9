"""Inside each vLLM worker: adapter revisions pushed by asyncroll, served by vLLM's LoRA.

A pushed revision becomes a ``LoRAModel`` registered with the worker's LoRA manager under its
revision id, between two engine steps (the RPC runs there), without a file or a pause. vLLM then
serves it as any LoRA: a request names it with a ``LoRARequest`` of the same id, and vLLM moves
it into a device slot when a step needs it. The worker keeps each revision's tensors
(``RevisionStore``) until asyncroll drops it, and answers vLLM's own load of a revision it
evicted from its caches from them, never from the (made-up) path.

Invariants:
- a revision is registered whole or not at all: the tensors are received and checked first
  (``asyncroll.receive.adapter``), the ``LoRAModel`` built and validated next, and only then
  registered; a push that fails leaves every served revision as it was;
- nothing served is written in place: a new revision takes a free slot, never a busy one.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

__all__ = ["RevisionStore", "store_of"]

logger = logging.getLogger(__name__)


def store_of(worker: Any) -> RevisionStore | None:
    """The worker's store of revisions (made on first use); None: LoRA is not enabled."""
    store = getattr(worker, "_asyncroll_revisions", None)
    if store is None:
        manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
        if manager is None or getattr(worker.vllm_config, "lora_config", None) is None:
            return None
        store = worker._asyncroll_revisions = RevisionStore(worker, manager)
    return store


class RevisionStore:
    """The revisions asyncroll pushed to one worker, and their registration with vLLM."""

    def __init__(self, worker: Any, manager: Any) -> None:
        self._worker = worker
        self._manager = manager
        """vLLM's ``LRUCacheWorkerLoRAManager``."""
        self._held: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        vllms_load = manager._load_adapter

        def load(lora_request: Any) -> Any:
            held = self._held.get(lora_request.lora_int_id)
            if held is None and str(lora_request.lora_path).startswith("asyncroll://"):
                raise RuntimeError(  # not vLLM's "no such folder" about a made-up path
                    f"LoRA revision {lora_request.lora_name} was dropped while a request still"
                    " named it (the manager drops only revisions no call is pinned to)"
                )
            if held is None:
                return vllms_load(lora_request)
            return self._build(lora_request.lora_int_id, *held)

        manager._load_adapter = load  # a revision vLLM evicted comes back from memory

    def layout(self) -> dict[str, Any]:
        """What this worker's LoRA serves (``asyncroll.adapters.AdapterLayout``)."""
        lora_config = self._manager.lora_config
        adapters = self._manager._adapter_manager
        packed = adapters.packed_modules_mapping
        modules: set[str] = set()
        for module in adapters.supported_lora_modules:
            modules.update(packed.get(module, [module]))
        return {
            "max_rank": int(lora_config.max_lora_rank),
            "slots": int(lora_config.max_loras),
            "resident": int(lora_config.max_cpu_loras or lora_config.max_loras),
            "modules": sorted(modules),
        }

    def add(self, revision: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Register a revision (built and validated first: a failure registers nothing), and
        move it into a free device slot if there is one."""
        lora = self._build(revision, tensors, config)
        adapters = self._manager._adapter_manager
        with _sync_allowed():
            self._manager.remove_adapter(revision)  # a retried push of the same revision
            if len(adapters) >= adapters.capacity:
                # As vLLM's own add does: its least recent LoRA goes (between two steps, so
                # no forward pass is using it); a revision of ours comes back from memory
                # when a step needs it again (``__init__``).
                adapters.remove_oldest_adapter()
            adapters.add_adapter(lora)
            self._held[revision] = (tensors, config)
            if None in adapters.lora_index_to_id:  # a step would do it; this is between steps
                adapters.activate_adapter(revision)

    def drop(self, revision: int) -> bool:
        """Forget a revision; True if it was held."""
        held = self._held.pop(revision, None) is not None
        with _sync_allowed():
            self._manager.remove_adapter(revision)
        return held

    def _build(
        self, revision: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]
    ) -> Any:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self._manager
        peft = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        peft.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None and hasattr(mapper, "get_rename_mapper"):
            mapper = mapper.get_rename_mapper()
        device = next(iter(tensors.values())).device
        # vLLM folds alpha / rank into each lora_B in place (``optimize``) wherever the tensor
        # it was given is already of its dtype: B goes in as a copy, so what the store keeps
        # stays unscaled for a rebuild (``_load_adapter``) and is never scaled twice.
        given = {n: t.clone() if ".lora_B." in n else t for n, t in tensors.items()}
        return LoRAModel.from_lora_tensors(
            lora_model_id=revision,
            tensors=given,
            peft_helper=peft,
            device=str(device),
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )


def _sync_allowed() -> contextlib.AbstractContextManager[Any]:
    """vLLM 0.32's guard that allows a device sync here (its debug mode flags others)."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:  # vLLM 0.24
        return contextlib.nullcontext()
    return gpu_sync_allowed()  # type: ignore[no-any-return]
