"""Moved to ``asyncroll.vllm.worker`` (kept for engines launched with the old
``worker_extension_cls="asyncroll.vllm_ext.AsyncrollWorkerExtension"``)."""

from asyncroll.vllm.worker import (
    BACKEND_NAME,
    AsyncrollWeightTransferEngine,
    AsyncrollWorkerExtension,
)

__all__ = ["BACKEND_NAME", "AsyncrollWeightTransferEngine", "AsyncrollWorkerExtension"]
