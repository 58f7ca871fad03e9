"""OpenMP and asyncroll's helper threads on the host."""

from __future__ import annotations

import ctypes

__all__ = ["one_openmp_thread"]


def one_openmp_thread() -> bool:
    """Make this thread's OpenMP parallel regions single-threaded (its own ICV: other threads
    keep theirs; ``torch.set_num_threads`` would also shrink MKL's pool for every thread).
    Returns whether an OpenMP runtime was found in the process.

    A thread that ran torch's parallel CPU ops keeps its own OpenMP team while it lives. With
    more OpenMP threads than cores, GNU OpenMP stops spinning between regions in every team,
    the engine's included: on the 2-core CPU machine an idle landing thread that had landed
    one push cost the CPU engine 15-23% of its tokens a second (session 38), and a second
    thread that ran one op cost a torch loop 13% (session 39,
    ``bench/openmp_second_thread_cpu.py``). asyncroll's own threads that copy on the host (a
    worker's landing thread, the sender's packer) call this first."""
    try:
        set_threads = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError):
        return False
    set_threads.argtypes = [ctypes.c_int]
    set_threads(1)
    return True
