"""asyncroll: async-first rollout layer for RL with LLMs."""

from asyncroll.engine import VLLMEngine
from asyncroll.manager import AsyncServerManager, Engine, ResumeMode
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
from asyncroll.types import (
    EngineStatistics,
    FinishReason,
    ManagerStatistics,
    PauseMode,
    Segment,
    TokenOutput,
)
from asyncroll.weights import UpdateReport, WeightPusher

__all__ = [
    "AsyncServerManager",
    "AsyncrollError",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineGenerateError",
    "EngineSleepingError",
    "EngineStatistics",
    "FinishReason",
    "ManagerStatistics",
    "InvalidRequestError",
    "NoEngineAvailableError",
    "PauseMode",
    "ResumeMode",
    "Segment",
    "TokenOutput",
    "TransportAuthError",
    "TransportBrokenError",
    "TransportClosedError",
    "TransportError",
    "TransportTimeoutError",
    "UpdateReport",
    "VLLMEngine",
    "WeightPusher",
    "WeightSyncError",
]
