"""Every difference between the vLLM versions asyncroll runs on (0.24 on the GPU machine, the
0.32 CPU build, 0.33), detected by feature, never by version number, in one place."""

from __future__ import annotations

import functools
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "engine_core_processes",
    "engine_monitor_threads",
    "rendezvous_files",
    "schedules_ahead",
    "on_request_added",
    "release_client",
    "seeded_split_prefill_kills",
    "labels_versions",
    "pause_generation",
    "num_unfinished_requests",
    "repacking_experts",
    "direct_load_refusal",
    "shutdown_weight_transfer",
    "worker_runs_the_session",
]


def engine_core_processes(llm: Any) -> list[Any]:
    """The EngineCore processes behind an ``AsyncLLM`` client (``multiprocessing`` processes,
    with a ``sentinel``), or none where the core runs in this process."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def engine_monitor_threads(llm: Any) -> list[threading.Thread]:
    """The threads vLLM's client runs to watch its EngineCore processes
    (``MPClientEngineMonitor``), found by the engine manager or client their target closes
    over. Once a process exits, such a thread reads its ``exitcode``: closing the process
    object under it raises ``ValueError`` in that thread."""
    client = getattr(llm, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    if client is None or manager is None:
        return []
    found = []
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)  # deleted once the target returns
        if thread.name != "MPClientEngineMonitor" or target is None:
            continue
        for cell in getattr(target, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if value is manager or _referent(value) is client:
                found.append(thread)
                break
    return found


def _referent(value: Any) -> Any:
    return value() if isinstance(value, weakref.ref) else None


def rendezvous_files(methods: Sequence[str | None]) -> list[Path]:
    """The files among the workers' ``distributed_init_method``s that vLLM made for its process
    group (``file://<temp>/vllm_dist_<hex>``, vLLM 0.32) and leaves behind: one an engine."""
    files = set()
    for method in methods:
        if method and method.startswith("file://"):
            path = Path(method.removeprefix("file://"))
            if path.parent == Path(tempfile.gettempdir()) and path.name.startswith("vllm_dist_"):
                files.add(path)
    return sorted(files)


def on_request_added(llm: Any, callback: Callable[[str], None]) -> None:
    """Call ``callback(request_id)`` each time ``llm.add_request`` returns or raises: by then
    the request was handed to the EngineCore's input socket (both 0.24 and 0.32 send it
    before returning), or never will be. A call sent on that socket afterwards (a pause)
    reaches the EngineCore after it. Wraps the method on this instance only."""
    add = llm.add_request

    @functools.wraps(add)
    async def add_request(request_id: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await add(request_id, *args, **kwargs)
        finally:
            callback(request_id)

    llm.add_request = add_request


def release_client(llm: Any) -> None:
    """After ``llm.shutdown()``: terminate the client's ZMQ context. vLLM closes the sockets
    (on the loop, a turn later) but leaves the context, its I/O thread and its descriptors to
    the garbage collector, which finds them only once nothing refers to the client."""
    context = getattr(getattr(llm, "engine_core", None), "ctx", None)
    # The client's asyncio context shadows a plain one, which owns the handle: end that one,
    # or its own finaliser would end the handle a second time. Each context knows only the
    # sockets made through it, and ending a context waits for every socket of the handle: close
    # both contexts' sockets first (vLLM has closed its own by now; this covers any it has not).
    owner = getattr(context, "_shadow_obj", None) or context
    if owner is None or getattr(owner, "closed", True):
        return
    for made_by in {id(context): context, id(owner): owner}.values():
        for socket in list(getattr(made_by, "_sockets", None) or ()):
            socket.close(linger=0)
    owner.destroy(linger=0)


def seeded_split_prefill_kills(llm: Any) -> bool:
    """A seeded request whose prefill is split across steps kills this engine: the CPU build
    rewinds the request's generator with ``set_offset``, which torch's CPU generator lacks
    (``vllm/v1/worker/gpu_model_runner.py``, the discarded tokens of partial prefills)."""
    from vllm.platforms import current_platform

    scheduler = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
    return bool(current_platform.is_cpu() and getattr(scheduler, "enable_chunked_prefill", False))


def schedules_ahead(llm: Any) -> bool:
    """vLLM schedules a step before the previous one's output is back (async scheduling: on
    by default on GPUs since 0.14, off on the CPU build)."""
    config = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
    return bool(getattr(config, "async_scheduling", False))


def labels_versions(llm: Any) -> bool:
    """vLLM labels weight versions itself and reports per-token version spans (0.32+)."""
    return hasattr(llm, "update_weight_version")


@functools.cache
def worker_runs_the_session() -> bool:
    """vLLM 0.24: the worker starts and finishes updates; 0.32+ leave it to the engine."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return not hasattr(WeightTransferEngine, "start_weight_update")


async def shutdown_weight_transfer(llm: Any) -> None:
    shutdown = getattr(llm, "shutdown_weight_transfer_engine", None)
    if shutdown is not None:
        await shutdown()
    else:  # vLLM 0.24 has no such call: our worker extension does it
        await llm.collective_rpc("asyncroll_shutdown_weight_transfer_engine")


def num_unfinished_requests(llm: Any) -> int:
    count = getattr(llm, "get_num_unfinished_requests", None)
    if count is None:  # vLLM 0.24
        count = llm.output_processor.get_num_unfinished_requests
    return int(count())


async def pause_generation(llm: Any, *, mode: str, clear_cache: bool) -> None:
    """vLLM's pause without AsyncLLM's fixed 20 ms sleep (it only orders outputs for its
    caller; the adapter settles vLLM's output queue itself before it counts tokens): the same
    two steps, the multimodal cache clear and the scheduler's pause, where the client has them."""
    pause = getattr(getattr(llm, "engine_core", None), "pause_scheduler_async", None)
    clear = getattr(getattr(llm, "renderer", None), "clear_mm_cache_async", None)
    if pause is None or (clear_cache and clear is None):
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache and clear is not None:
        await clear()
    await pause(mode=mode, clear_cache=clear_cache)


def repacking_experts(model: Any) -> list[str]:
    """The mixture-of-experts layers of ``model`` whose expert kernel keeps the weights in a
    layout of its own (the CPU build's grouped GEMM prepacks them: ``fused_experts`` overrides
    ``process_weights_after_loading``), by module name. A push must reach them through vLLM's
    layerwise reload, which loads into the checkpoint layout and processes again; a direct copy
    into their parameters would be read in the wrong layout.

    vLLM 0.32 runs that processing on the first load only: on a reload its unquantized MoE
    method skips ``fused_experts.process_weights_after_loading`` (it takes a set ``moe_kernel``
    to mean a weight update whose layout is already final), so a reloaded layer would be served
    unpacked. Each such layer's method is wrapped, once, to run the experts' processing after
    its own whenever the method did not run it itself (the layerwise reload then copies the
    processed tensors into the served ones)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    layers = []
    for name, module in model.named_modules():
        found = getattr(module, "quant_method", None)
        if not isinstance(found, UnquantizedFusedMoEMethod):  # (quantized ones: not ours)
            continue
        method: Any = found
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or not _processes_weights(experts):
            continue
        layers.append(name)
        if not getattr(method, "_asyncroll_reprocesses", False):
            method.process_weights_after_loading = _reprocessing(method)
            method._asyncroll_reprocesses = True
    return layers


def direct_load_refusal(layers: Sequence[str]) -> str:
    """Why a ``load="direct"`` push cannot go into these prepacked expert ``layers``."""
    more = f" and {len(layers) - 1} more layers" if len(layers) > 1 else ""
    return (
        f"load='direct' cannot push into {layers[0]!r}{more}: its expert kernel keeps the"
        " weights in a layout of its own (vLLM's CPU mixture of experts); use load='layerwise'"
    )


def _processes_weights(experts: Any) -> bool:
    from vllm.model_executor.layers.fused_moe import modular_kernel

    base = modular_kernel.FusedMoEExpertsModular.process_weights_after_loading
    own = getattr(type(experts), "process_weights_after_loading", base)
    return own is not base


def _reprocessing(method: Any) -> Callable[[Any], None]:
    process = method.process_weights_after_loading

    @functools.wraps(process)
    def process_weights_after_loading(layer: Any) -> None:
        experts = method.moe_kernel.fused_experts
        ran = []
        own = experts.process_weights_after_loading

        def noted(layer: Any) -> None:
            ran.append(True)
            own(layer)

        experts.process_weights_after_loading = noted
        try:
            process(layer)
        finally:
            del experts.process_weights_after_loading
        # Only where vLLM kept this kernel and did not process with it: a kernel it built
        # anew (weights loaded pre-processed, say) has done its own processing, and the CPU
        # prepack must never run twice on one set of weights.
        if not ran and method.moe_kernel.fused_experts is experts and not _pre_processed():
            own(layer)

    return process_weights_after_loading


def _pre_processed() -> bool:
    """vLLM 0.32's flag for weights loaded already in the kernel's format (0.24 has none)."""
    try:
        from vllm.model_executor.utils import is_weights_pre_processed
    except ImportError:
        return False
    return bool(is_weights_pre_processed())
