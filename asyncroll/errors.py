"""asyncroll's error tree: one root, drawn once.

```
AsyncrollError
├── EngineError
│   ├── EngineGenerateError     one request failed; the engine is fine
│   ├── EngineDeadError         the engine is gone; the manager stops routing to it
│   ├── EngineStartError        an engine could not start
│   ├── EngineSleepingError     the engine is asleep; it refuses weights and requests
│   └── NoEngineAvailableError  no engine is left to route to
├── TransportError
│   ├── TransportClosedError    we closed it
│   ├── TransportBrokenError    the peer vanished or answered with an error
│   │   └── TransportTimeoutError  a peer did not answer within its deadline (also a TimeoutError)
│   └── TransportAuthError      a peer failed authentication (wrong secret)
├── WeightSyncError             a push failed; the old version stays in force
│   ├── ReceiverFailedError     the sender's side went well; a receiver failed its part
│   └── PieceNotPlannedError    a receiver cannot load a piece of a tensor; push it whole
├── ManagerClosedError          a call on a closed AsyncServerManager (also a RuntimeError)
└── InvalidRequestError         bad input, caught before it reaches an engine (also a ValueError)
```
Third-party errors are mapped onto this tree at the boundary with ``raise ... from exc``.

One warning: ``UnchangedWeightsWarning`` (a ``UserWarning``), an update said to change the
weights that pushed exactly the previous update's.
"""

from __future__ import annotations

__all__ = [
    "AsyncrollError",
    "EngineDeadError",
    "EngineError",
    "EngineGenerateError",
    "EngineSleepingError",
    "EngineStartError",
    "InvalidRequestError",
    "ManagerClosedError",
    "NoEngineAvailableError",
    "PieceNotPlannedError",
    "ReceiverFailedError",
    "TransportAuthError",
    "TransportBrokenError",
    "TransportClosedError",
    "TransportError",
    "TransportTimeoutError",
    "UnchangedWeightsWarning",
    "WeightSyncError",
]


class AsyncrollError(Exception):
    """Root of every error asyncroll raises on purpose."""


class EngineError(AsyncrollError):
    """Something went wrong in or with an inference engine."""


class EngineGenerateError(EngineError):
    """One request failed; the engine itself is fine."""


class EngineDeadError(EngineError):
    """The engine is gone (its EngineCore died or it was closed); route elsewhere."""


class EngineStartError(EngineError):
    """An engine could not start (no such model folder, bad engine arguments, vLLM failed)."""


class EngineSleepingError(EngineError):
    """The engine is asleep: it accepts neither requests nor weights until woken."""


class NoEngineAvailableError(EngineError):
    """No live engine is left to serve a request."""


class TransportError(AsyncrollError):
    """The weight-push transport failed."""


class TransportClosedError(TransportError):
    """The transport was closed by us."""


class TransportBrokenError(TransportError):
    """The peer vanished or answered with an error."""


class TransportTimeoutError(TransportBrokenError, TimeoutError):
    """A peer did not answer within its configured deadline."""


class TransportAuthError(TransportError):
    """A peer failed authentication: it does not hold this job's secret."""


class WeightSyncError(AsyncrollError):
    """A weight push failed; the previous weights and version stay in force."""


class ReceiverFailedError(WeightSyncError):
    """The sender completed a push that a receiver failed (its engine's error says why)."""


class PieceNotPlannedError(WeightSyncError):
    """A receiver was pushed a piece of a tensor (``asyncroll.transport.piece``) that its load
    plan cannot load: it needs the whole tensor. Nothing of the piece's batch was loaded; a
    push of whole tensors succeeds."""


class ManagerClosedError(AsyncrollError, RuntimeError):
    """A call on an ``AsyncServerManager`` after its ``aclose()``."""


class InvalidRequestError(AsyncrollError, ValueError):
    """Bad input, caught before it reached an engine."""


class UnchangedWeightsWarning(UserWarning):
    """An update called with ``changed=True`` pushed tensors whose fingerprints all equal the
    previous update's: the trainer probably pushed stale weights (a step that did not apply,
    the wrong model object). The push itself went through."""
