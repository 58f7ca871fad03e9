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
from asyncroll.manager import AsyncServerManager, Engine, ResumeMode, WeightUpdater
from asyncroll.transport import (
    PushReport,
    WeightReceiver,
    WeightSender,
    open_weight_sender,
    plan_buckets,
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
    "InvalidRequestError",
    "ManagerStatistics",
    "NoEngineAvailableError",
    "PauseMode",
    "PushReport",
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
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightUpdater",
    "open_weight_sender",
    "plan_buckets",
]
