"""asyncroll: async-first rollout layer for RL with LLMs."""

from asyncroll.engine import VLLMEngine
from asyncroll.errors import (
    AsyncrollError,
    EngineDeadError,
    EngineError,
    EngineGenerateError,
    EngineSleepingError,
    InvalidRequestError,
    NoEngineAvailableError,
    TransportAuthError,
    TransportBrokenError,
    TransportClosedError,
    TransportError,
    TransportTimeoutError,
    WeightSyncError,
)
from asyncroll.types import EngineStatistics, FinishReason, PauseMode, Segment

__all__ = [
    "AsyncrollError",
    "EngineDeadError",
    "EngineError",
    "EngineGenerateError",
    "EngineSleepingError",
    "EngineStatistics",
    "FinishReason",
    "InvalidRequestError",
    "NoEngineAvailableError",
    "PauseMode",
    "Segment",
    "TransportAuthError",
    "TransportBrokenError",
    "TransportClosedError",
    "TransportError",
    "TransportTimeoutError",
    "VLLMEngine",
    "WeightSyncError",
]
