"""The gateway's one error: a request it refuses, with what OpenAI's error format needs."""

from __future__ import annotations

from typing import Any

from asyncroll.errors import InvalidRequestError

__all__ = ["ChatRequestError"]


class ChatRequestError(InvalidRequestError):
    """A request the gateway refuses, with what OpenAI's error format needs."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.type = type

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's API answers errors with."""
        return {
            "error": {"message": str(self), "type": self.type, "param": self.param,
                      "code": self.code}
        }
