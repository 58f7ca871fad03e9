"""An OpenAI-compatible gateway: train agents written against the OpenAI API, token-exact.

Needs the ``gateway`` extra (FastAPI, uvicorn, a Hugging Face tokenizer). See
``asyncroll.gateway.server`` for the routes and ``asyncroll.gateway.session`` for how a
session's tokens are kept exact across turns.
"""

from asyncroll.gateway.chat import ChatRequestError
from asyncroll.gateway.render import HFChatRenderer
from asyncroll.gateway.server import Gateway, GatewaySession, GatewayStatistics, open_gateway
from asyncroll.gateway.session import ChatRenderer, SessionResult
from asyncroll.gateway.source import GatewaySource

__all__ = [
    "ChatRenderer",
    "ChatRequestError",
    "Gateway",
    "GatewaySession",
    "GatewaySource",
    "GatewayStatistics",
    "HFChatRenderer",
    "SessionResult",
    "open_gateway",
]
