"""What the gateway checks of an HTTP request before it reads its meaning: who may ask, and
whether the body is JSON it can take.

Invariants:
- Every check raises ``ChatRequestError`` (a 4xx); none lets a client's bytes raise anything
  else: a body past ``max_bytes`` (413, read no further), one typed other than
  ``application/json`` (415: any web page may post ``text/plain`` or a form to localhost; an
  untyped body is taken as JSON), not UTF-8, not JSON, a number past a double, or nested past
  what the decoder takes (400).
- ``check_host`` serves a ``Host`` that is an IP address, ``localhost`` or an allowed name;
  DNS rebinding needs a name of the attacker's, which is none of these.
- ``reward_value`` is a finite float or None.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncroll.gateway.errors import ChatRequestError

__all__ = ["BodyRules", "check_host", "decode_json", "read_json", "reward_value"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BodyRules:
    max_bytes: int
    """The largest body read; past it, 413."""
    hosts: frozenset[str] | None
    """Host names served besides IP addresses and localhost; None: any (an API key guards)."""


def check_host(headers: Mapping[str, str], rules: BodyRules) -> None:
    if rules.hosts is None:
        return
    host = _hostname(headers.get("host", ""))
    if host == "localhost" or host in rules.hosts or _is_ip(host):
        return
    raise ChatRequestError(
        f"Host {host!r} is not served without an API key: use an IP address or localhost, "
        "pass allowed_hosts=, or set api_key=", status=403, code="host_not_allowed")


def _hostname(host: str) -> str:
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0].lower() if host.count(":") == 1 else host.lower()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def read_json(stream: AsyncIterator[bytes], headers: Mapping[str, str], rules: BodyRules,
                    *, empty: Any = None) -> Any:
    """The decoded body; ``empty`` for an empty one (an error where None)."""
    declared = headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > rules.max_bytes):
        raise _too_large(rules) if declared.isdigit() else ChatRequestError(
            "a malformed Content-Length")
    chunks, size = [], 0
    async for chunk in stream:
        size += len(chunk)
        if size > rules.max_bytes:
            raise _too_large(rules)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        if empty is None:
            raise ChatRequestError("the request body is empty; send a JSON object")
        return empty
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in ("application/json", ""):  # untyped: no browser sends a body so
        raise ChatRequestError(
            f"the body must be application/json, not {media or 'untyped'!r}", status=415,
            code="unsupported_media_type")
    return decode_json(raw)


def _too_large(rules: BodyRules) -> ChatRequestError:
    return ChatRequestError(f"the body is larger than {rules.max_bytes} bytes", status=413,
                            code="request_too_large")


def decode_json(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except RecursionError as exc:
        raise ChatRequestError("the body's JSON is nested too deeply") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # ValidationError: a huge number
        raise ChatRequestError(f"the body is not valid JSON: {exc}") from exc


def reward_value(reward: object) -> float | None:
    """``reward`` as a finite float (None stays None)."""
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ChatRequestError("'reward' must be a number", param="reward")
    try:
        value = float(reward)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ChatRequestError(f"'reward' must be finite, not {str(reward)[:40]}",
                               param="reward")
    return value
