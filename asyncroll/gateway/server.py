"""The OpenAI-compatible HTTP gateway over an ``AsyncServerManager``.

```python
async with open_gateway(manager, tokenizer=model_dir, model="policy") as gateway:
    session = gateway.open_session()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key="-")
    reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
    ...
    result = await gateway.finish_session(session.id, reward=1.0)  # exact tokens, mask, versions
```

Routes: ``POST /v1/chat/completions`` and ``POST /v1/responses`` (each streaming with
``"stream": true``), ``GET /v1/models``, the same under ``/s/{session_id}/v1/`` (a base URL per
session), ``POST /sessions`` and ``POST /sessions/{session_id}/finish``. A request names its
session by the path or an ``X-Session-Id`` header (a Responses request also by its
``previous_response_id``); one that names none continues the session whose recorded
conversation it extends (``asyncroll.gateway.matching``), or opens one; either way the reply
says which in ``X-Session-Id``. So an agent on the plain ``/v1`` base URL records one
trajectory per conversation.

Invariants:
- A session runs one turn at a time (a per-session lock); sessions run concurrently.
- A refused request (bad JSON, a body too large, too deep or not ``application/json``, unknown
  model, unsupported parameter, a feature the engines cannot serve, over-long conversation,
  unknown session, wrong API key, a ``Host`` not allowed) is a 4xx in OpenAI's error format;
  it reaches no engine and changes no session. Nothing a client sends is answered with a 5xx:
  those are for no engine able to serve (503) and the gateway's own bugs (500).
- Without an API key, only requests whose ``Host`` is an IP address, ``localhost`` or one of
  ``allowed_hosts`` are served: a web page cannot reach the gateway by DNS rebinding.
- The server lives in a task owned by ``open_gateway``'s block; leaving the block stops it and
  closes its socket, whatever happened inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncroll.errors import InvalidRequestError, ManagerClosedError, NoEngineAvailableError
from asyncroll.gateway import responses
from asyncroll.gateway.chat import (
    AssistantReply,
    ChatRequest,
    ChatRequestError,
    assistant_reply,
    message_key,
    parse_chat_request,
)
from asyncroll.gateway.constraints import cut_at_stop
from asyncroll.gateway.http import BodyRules, check_host, read_json, reward_value
from asyncroll.gateway.matching import Candidate, continued_session, opening
from asyncroll.gateway.render import HFChatRenderer
from asyncroll.gateway.session import ChatRenderer, PreparedTurn, Session, SessionResult
from asyncroll.types import TokenOutput, version_range

if TYPE_CHECKING:
    from asyncroll.manager import AsyncServerManager

__all__ = ["Gateway", "GatewaySession", "GatewayStatistics", "ReplyParser", "open_gateway"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

Turn = tuple[ChatRequest, Session, TokenOutput, AssistantReply, bool]
"""A served turn: the checked request, its session, the output, the parsed reply, whether it
forked the session's trajectory."""


class ReplyParser(Protocol):
    def __call__(self, text: str, *, tools: bool) -> AssistantReply: ...


_SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,96}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewaySession:
    """How an agent reaches its session: point an OpenAI client at ``base_url``."""

    id: str
    base_url: str

    @property
    def headers(self) -> dict[str, str]:
        """For clients that keep one base URL: send these with each request."""
        return {"X-Session-Id": self.id}


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayStatistics:
    open_sessions: int
    finished_sessions: int
    num_requests: int
    num_turns: int
    num_refused: int
    """Requests answered with a 4xx."""
    num_failed: int
    """Requests answered with a 5xx (no engine, closed manager, a bug)."""
    num_forks: int
    """Turns whose rendered prompt did not extend the recorded tokens (template drift)."""


@dataclass(slots=True)
class _Counts:
    finished: int = 0
    requests: int = 0
    refused: int = 0
    failed: int = 0
    forks: int = 0
    turns: int = 0


class Gateway:
    """Serves OpenAI chat requests from a manager and records each session's exact tokens.

    Made by ``open_gateway``; its ``app`` is a FastAPI application you may also mount yourself.
    """

    def __init__(
        self,
        manager: AsyncServerManager,
        renderer: ChatRenderer,
        *,
        model: str,
        api_key: str | None = None,
        auto_sessions: bool = True,
        max_sessions: int = 4096,
        reply_parser: ReplyParser = assistant_reply,
        auto_session_idle_s: float = 600.0,
        allowed_hosts: Sequence[str] = (),
        max_body_bytes: int | None = None,
    ) -> None:
        """Args:
            manager: Where turns are generated.
            renderer: The model's chat template and tokenizer (``HFChatRenderer``).
            model: The name clients pass as ``model``.
            api_key: If set, every request must carry ``Authorization: Bearer <api_key>``.
            auto_sessions: Open a session for a request that names none.
            max_sessions: Most open sessions; opening one more is refused (429).
            reply_parser: Turns a generated turn's text into the reply (reasoning, content, tool
                calls): Hermes by default; wrap another model family's parser (e.g. one of
                vLLM's tool parsers) in the same signature.
            auto_session_idle_s: A session the gateway opened for a request that named none
                is dropped once it has been idle this long (checked when another opens).
            allowed_hosts: Host names served without an API key besides IP addresses and
                ``localhost`` (the ``Host`` check against DNS rebinding).
            max_body_bytes: The largest request body (413 past it); by default 64 bytes per
                token of the engines' context, at least 1 MiB.
        """
        if not isinstance(model, str) or not model:
            raise InvalidRequestError(f"the gateway needs a model name, not {model!r}")
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) \
                or max_sessions < 1:
            raise InvalidRequestError(f"max_sessions must be a positive int, not {max_sessions!r}")
        if not isinstance(auto_session_idle_s, int | float) or not auto_session_idle_s > 0:
            raise InvalidRequestError(
                f"auto_session_idle_s must be a positive number, not {auto_session_idle_s!r}")
        self.manager = manager
        self.renderer = renderer
        self.model = model
        self.url = ""
        """``http://host:port`` once serving (set by ``open_gateway``)."""
        self._api_key = api_key
        self._auto_sessions = auto_sessions
        self._parse_reply = reply_parser
        self._auto_idle = auto_session_idle_s
        self._auto: set[str] = set()
        self._max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._counts = _Counts()
        self._openings: dict[str, set[str]] = {}
        """How a conversation opens (``matching.opening``) -> the auto sessions opened so."""
        self._opening_of: dict[str, str] = {}
        self._responses: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        """Response id -> its session and its conversation (``previous_response_id``)."""
        self._responses_of: dict[str, list[str]] = {}
        context = min(engine.max_model_len for engine in manager.engines)
        self._body_rules = BodyRules(
            max_bytes=max_body_bytes if max_body_bytes is not None
            else max(1 << 20, 64 * context),
            hosts=frozenset(allowed_hosts) if api_key is None else None)
        self.app = self._make_app()

    def __repr__(self) -> str:
        return (f"<Gateway {self.url or 'not serving'} model={self.model} "
                f"sessions={len(self._sessions)}>")

    def statistics(self) -> GatewayStatistics:
        counts = self._counts
        return GatewayStatistics(
            open_sessions=len(self._sessions), finished_sessions=counts.finished,
            num_requests=counts.requests, num_turns=counts.turns, num_refused=counts.refused,
            num_failed=counts.failed, num_forks=counts.forks,
        )

    def open_session(self, session_id: str | None = None, *, data: Mapping[str, Any] | None = None
                     ) -> GatewaySession:
        """Open a session (a fresh unguessable id by default).

        Raises:
            ChatRequestError: a malformed or taken id (400/409), or too many sessions (429).
        """
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
            raise ChatRequestError(
                f"a session id is 1-96 characters of [A-Za-z0-9_.-], not {session_id!r}",
                param="session_id",
            )
        if session_id in self._sessions:
            raise ChatRequestError(f"session {session_id!r} is already open", status=409,
                                   code="session_exists")
        if len(self._sessions) >= self._max_sessions:
            raise ChatRequestError(f"{self._max_sessions} sessions are open already",
                                   status=429, code="too_many_sessions")
        budget = min(engine.max_model_len for engine in self.manager.engines)
        self._sessions[session_id] = Session(session_id, self.renderer, budget=budget,
                                             data=dict(data or {}))
        self._locks[session_id] = asyncio.Lock()
        return GatewaySession(id=session_id, base_url=f"{self.url}/s/{session_id}/v1")

    async def finish_session(self, session_id: str, *, reward: float | None = None
                             ) -> SessionResult:
        """Close a session (after its running turn, if any) and return its training data.

        Raises:
            ChatRequestError: no open session has this id (404), or ``reward`` is not a finite
                number (400; the session stays open).
        """
        reward = reward_value(reward)
        self._session(session_id)
        async with self._locks[session_id]:
            session = self._session(session_id)  # a concurrent finish may have won
            self._drop(session_id)
            self._counts.finished += 1
        return session.result(reward)

    def auto_session_ids(self) -> list[str]:
        """The open sessions the gateway opened for requests that named none."""
        return [session_id for session_id in self._sessions if session_id in self._auto]

    async def chat(self, body: object, *, session_id: str | None = None) -> Turn:
        """One chat turn, without HTTP: check, render, generate, record.

        Returns:
            The checked request, its session, the output, the parsed reply, and whether the
            turn forked the session's trajectory.

        Raises:
            ChatRequestError: a refused request (see the module invariants).
            NoEngineAvailableError, ManagerClosedError: no engine can serve.
        """
        return await self._serve(parse_chat_request(body, models=(self.model,)), session_id)

    async def respond(self, body: object, *, session_id: str | None = None
                      ) -> tuple[Turn, dict[str, Any]]:
        """One Responses API turn, without HTTP: as ``chat``, and the ``response`` object.

        Raises:
            ChatRequestError: a refused request, or an unknown ``previous_response_id`` (404).
            NoEngineAvailableError, ManagerClosedError: no engine can serve.
        """
        call = responses.chat_body(body)
        earlier: list[dict[str, Any]] = []
        if call.previous_response_id is not None:
            owner, earlier = self._previous(call.previous_response_id, session_id)
            session_id = owner
        request = parse_chat_request(
            {**call.chat, "messages": [*call.instructions, *earlier, *call.input]},
            models=(self.model,))
        turn = await self._serve(request, session_id)
        _, session, output, reply, fork = turn
        rid = responses.response_id()
        kept = [*request.messages[len(call.instructions):], reply.message()]
        self._responses[rid] = (session.id, kept)
        self._responses_of.setdefault(session.id, []).append(rid)
        body = {**body, "previous_response_id": call.previous_response_id} \
            if isinstance(body, dict) else {}
        return turn, responses.response_body(
            rid=rid, model=self.model, body=body, items=responses.output_items(reply, rid),
            usage={"prompt": output.num_prompt_tokens, "completion": len(output.token_ids),
                   "cached": output.num_cached_tokens},
            finish=output.finish_reason, extra=_extra(session, output, fork))

    def _previous(self, response_id: str, session_id: str | None
                  ) -> tuple[str, list[dict[str, Any]]]:
        found = self._responses.get(response_id)
        if found is None or found[0] not in self._sessions:
            raise ChatRequestError(f"no response {response_id!r} in an open session",
                                   status=404, code="previous_response_not_found",
                                   param="previous_response_id")
        if session_id is not None and session_id != found[0]:
            raise ChatRequestError(f"response {response_id!r} belongs to another session",
                                   param="previous_response_id")
        return found

    async def _serve(self, request: ChatRequest, session_id: str | None) -> Turn:
        """A turn on the named session, the one the conversation continues, or a new one."""
        if session_id is not None:
            return await self._turn(request, session_id)
        if not self._auto_sessions:
            raise ChatRequestError("name a session: /s/<id>/v1/... or X-Session-Id",
                                   code="session_required")
        keys = [message_key(message) for message in request.messages]
        found = self._continued(request.messages, keys)
        if found is not None:
            return await self._turn(request, found, keys)
        self._drop_idle_auto_sessions()
        session_id = self.open_session().id
        self._auto.add(session_id)
        try:
            turn = await self._turn(request, session_id, keys)
        except BaseException:
            self._drop(session_id)  # its first turn failed: nothing to keep
            raise
        key = self._opening_of[session_id] = opening(request.messages)
        self._openings.setdefault(key, set()).add(session_id)
        return turn

    def _continued(self, messages: list[dict[str, Any]], keys: list[str]) -> str | None:
        candidates = [
            Candidate(session_id, session.record, session.last_used,
                      self._locks[session_id].locked())
            for session_id in self._openings.get(opening(messages), ())
            if (session := self._sessions.get(session_id)) is not None
        ]
        return continued_session(messages, keys, candidates)

    def _drop_idle_auto_sessions(self) -> None:
        """Auto sessions nobody finishes (a plain OpenAI client) must not fill the table."""
        now = time.monotonic()
        for session_id in list(self._auto):
            session = self._sessions.get(session_id)
            lock = self._locks.get(session_id)
            if session is None:
                self._auto.discard(session_id)
            elif now - session.last_used > self._auto_idle and lock is not None \
                    and not lock.locked():
                logger.info("dropping idle auto session %s", session_id)
                self._drop(session_id)

    def _drop(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._locks.pop(session_id, None)
        self._auto.discard(session_id)
        key = self._opening_of.pop(session_id, None)
        if key is not None:
            opened = self._openings.get(key, set())
            opened.discard(session_id)
            if not opened:
                self._openings.pop(key, None)
        for response_id in self._responses_of.pop(session_id, ()):
            self._responses.pop(response_id, None)

    async def _turn(self, request: ChatRequest, session_id: str,
                    keys: list[str] | None = None) -> Turn:
        self._session(session_id)
        self._check_engines_serve(request)
        lock = self._locks[session_id]
        async with lock:
            session = self._session(session_id)
            if self._locks.get(session_id) is not lock:  # finished and opened anew meanwhile
                raise ChatRequestError(f"session {session_id!r} was finished",
                                       status=404, code="session_not_found")
            turn = self._prepare(session, request, keys)
            params = dict(request.sampling_params)
            if not params.get("ignore_eos"):  # end turns where the renderer ends them
                params["stop_token_ids"] = sorted(self.renderer.eos_token_ids)
            started = time.perf_counter()
            try:
                output = await self.manager.generate(
                    f"{session.id}/{session.num_turns}", prompt_ids=turn.prompt_ids,
                    sampling_params=params, session_key=session.id,
                )
            except ChatRequestError:
                raise
            except InvalidRequestError as exc:
                raise ChatRequestError(str(exc)) from exc
            text = session.reply_text(output.token_ids)
            if request.stop:  # the content ends before the stop string; the tokens keep it
                text = cut_at_stop(text, request.stop)[0]
            reply = self._parse_reply(text, tools=bool(request.tools))
            session.commit(turn, output, reply, seconds=time.perf_counter() - started)
        self._counts.turns += 1
        self._counts.forks += turn.fork
        return request, session, output, reply, turn.fork

    def _check_engines_serve(self, request: ChatRequest) -> None:
        needs = request.needs_tokenizer
        if needs is None or all(getattr(engine, "has_tokenizer", False)
                                for engine in self.manager.engines):
            return
        feature, param = needs
        raise ChatRequestError(
            f"{feature} need engines with a tokenizer, and this gateway's engines run without "
            "one (skip_tokenizer_init=True, or a model folder without tokenizer files): start "
            "them with the model's tokenizer (VLLMEngine.launch(model_dir) loads it by default)",
            code="unsupported_parameter", param=param)

    def _prepare(self, session: Session, request: ChatRequest, keys: list[str] | None
                 ) -> PreparedTurn:
        self._check_length_bound(request)
        try:
            turn = session.prepare(request.messages, request.tools, keys=keys)
        except Exception as exc:  # jinja raises its own errors on conversations it rejects
            raise ChatRequestError(
                f"the chat template could not render the conversation: {exc}", param="messages"
            ) from exc
        limit = min(engine.max_model_len for engine in self.manager.engines)
        if len(turn.prompt_ids) >= limit:
            raise ChatRequestError(
                f"the conversation is {len(turn.prompt_ids)} tokens; the model's context is "
                f"{limit}", code="context_length_exceeded", param="messages",
            )
        return turn

    def _check_length_bound(self, request: ChatRequest) -> None:
        """Refuse a conversation too long for the context before rendering and tokenizing it
        (which take the event loop about 6 s a MB): its text is at least its characters over
        the longest token's many tokens."""
        widest = getattr(self.renderer, "max_token_chars", None)
        if not isinstance(widest, int) or widest < 1:
            return
        chars = sum(len(m["content"] or "") for m in request.messages)
        if request.tools:
            chars += len(msgspec.json.encode(request.tools))
        limit = min(engine.max_model_len for engine in self.manager.engines)
        if chars > limit * widest:
            raise ChatRequestError(
                f"the conversation is at least {chars // widest} tokens ({chars} characters); "
                f"the model's context is {limit}", code="context_length_exceeded",
                param="messages")

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise ChatRequestError(f"no open session {session_id!r} on this gateway",
                                   status=404, code="session_not_found")
        return session

    def _authorize(self, headers: Mapping[str, str]) -> None:
        if self._api_key is None:
            check_host(headers, self._body_rules)
            return
        given = headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self._api_key.encode()):
            raise ChatRequestError("a valid API key is required", status=401,
                                   code="invalid_api_key")

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="asyncroll gateway", docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.exception_handler(ChatRequestError)
        async def refused(request: Request, exc: ChatRequestError) -> Response:
            self._counts.refused += 1
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
            self._counts.refused += 1
            error = ChatRequestError(f"{request.method} {request.url.path}: {exc.detail}",
                                     status=exc.status_code)
            return JSONResponse(error.body(), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def failed(request: Request, exc: Exception) -> Response:
            self._counts.failed += 1
            logger.error("gateway request failed: %r", exc, exc_info=exc)
            error = ChatRequestError(f"internal error: {type(exc).__name__}", status=500,
                                     type="server_error", code="internal_error")
            return JSONResponse(error.body(), status_code=500)

        async def models(request: Request) -> Response:
            self._authorize(request.headers)
            return JSONResponse({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "asyncroll"}]})

        async def completions(request: Request) -> Response:
            served = await self._over_http(request, self.chat)
            if isinstance(served, Response):
                return served
            chat, session, output, reply, fork = served
            headers = {"X-Session-Id": session.id}
            completion = _completion(self, chat, session, output, reply, fork)
            if chat.stream:
                return StreamingResponse(_sse(completion, chat), headers=headers,
                                         media_type="text/event-stream")
            return Response(msgspec.json.encode(completion), headers=headers,
                            media_type="application/json")

        async def respond(request: Request) -> Response:
            served = await self._over_http(request, self.respond)
            if isinstance(served, Response):
                return served
            (chat, session, *_), body = served
            headers = {"X-Session-Id": session.id}
            if chat.stream:
                return StreamingResponse(_events(body), headers=headers,
                                         media_type="text/event-stream")
            return Response(msgspec.json.encode(body), headers=headers,
                            media_type="application/json")

        async def open_session(request: Request) -> Response:
            self._authorize(request.headers)
            session = self.open_session()
            return JSONResponse({"id": session.id, "base_url": session.base_url})

        async def finish(request: Request) -> Response:
            self._authorize(request.headers)
            body = await read_json(request.stream(), request.headers, self._body_rules,
                                   empty={})
            reward = reward_value(body.get("reward") if isinstance(body, dict) else None)
            result = await self.finish_session(request.path_params["session_id"], reward=reward)
            return JSONResponse(_result_json(result))

        for prefix in ("", "/s/{session_id}"):
            app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
            app.add_api_route(f"{prefix}/v1/chat/completions", completions, methods=["POST"])
            app.add_api_route(f"{prefix}/v1/responses", respond, methods=["POST"])
        app.add_api_route("/sessions", open_session, methods=["POST"])
        app.add_api_route("/sessions/{session_id}/finish", finish, methods=["POST"])
        return app

    async def _over_http(self, request: Request, serve: Callable[..., Awaitable[_T]]
                         ) -> _T | Response:
        """Check, read and serve one request; a Response where it ends otherwise (the client
        left: 499; no engine can serve: 503)."""
        self._counts.requests += 1
        self._authorize(request.headers)
        session_id = request.path_params.get("session_id") or request.headers.get(
            "x-session-id")
        body = await read_json(request.stream(), request.headers, self._body_rules)
        try:
            served = await _unless_disconnected(request, serve(body, session_id=session_id))
        except RecursionError as exc:  # a body nested past what the template or json takes
            raise ChatRequestError("the body's JSON is nested too deeply") from exc
        except (NoEngineAvailableError, ManagerClosedError) as exc:
            self._counts.failed += 1
            error = ChatRequestError(str(exc), status=503, type="server_error",
                                     code="unavailable")
            return JSONResponse(error.body(), status_code=503)
        if served is None:  # the client left: the turn was aborted and not recorded
            return Response(status_code=499)
        return served


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """``work``'s result, or None (with ``work`` cancelled) if the client disconnects first:
    once the body is read, the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, left], return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
    if task.cancelled():
        return None
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _completion(gateway: Gateway, chat: ChatRequest, session: Session, output: TokenOutput,
                reply: AssistantReply, fork: bool) -> dict[str, Any]:
    finish = "tool_calls" if reply.tool_calls else (
        output.finish_reason if output.finish_reason in ("length", "abort") else "stop")
    choice: dict[str, Any] = {"index": 0, "message": reply.message(), "finish_reason": finish,
                              "logprobs": None}
    if chat.logprobs:
        choice["logprobs"] = {"content": [
            {"token": gateway.renderer.decode([token]), "logprob": log_prob, "bytes": None,
             "top_logprobs": []}
            for token, log_prob in zip(output.token_ids, output.log_probs, strict=True)
        ]}
    return {
        "id": f"chatcmpl-{session.id}-{session.num_turns - 1}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": gateway.model,
        "choices": [choice],
        "usage": {"prompt_tokens": output.num_prompt_tokens,
                  "completion_tokens": len(output.token_ids),
                  "total_tokens": output.num_prompt_tokens + len(output.token_ids)},
        "asyncroll": _extra(session, output, fork),
    }


def _extra(session: Session, output: TokenOutput, fork: bool) -> dict[str, Any]:
    """What a reply says of its turn under ``asyncroll``."""
    low, high = version_range(output.global_steps)
    return {"session_id": session.id, "min_global_steps": low, "max_global_steps": high,
            "num_preempted": output.num_preempted, "fork": fork}


async def _sse(completion: dict[str, Any], chat: ChatRequest) -> AsyncIterator[bytes]:
    """The finished turn as OpenAI's stream of ``chat.completion.chunk`` events."""
    base = {key: completion[key] for key in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    choice = completion["choices"][0]
    message = choice["message"]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message.get("reasoning_content") is not None:
        deltas.append({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        deltas.append({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls") or ()):
        deltas.append({"tool_calls": [{"index": index, **call}]})
    for delta in deltas:
        yield _event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                           "logprobs": None}]})
    yield _event({**base, "choices": [{"index": 0, "delta": {},
                                       "finish_reason": choice["finish_reason"],
                                       "logprobs": choice["logprobs"]}]})
    if chat.include_usage:
        yield _event({**base, "choices": [], "usage": completion["usage"]})
    yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def _events(response: dict[str, Any]) -> AsyncIterator[bytes]:
    for event in responses.response_events(response):
        yield event


def _server_class() -> type[Any]:
    """A uvicorn server that leaves the process's signal handlers alone: Ctrl-C belongs to the
    program the gateway serves in, not to the gateway."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server


def _result_json(result: SessionResult) -> dict[str, Any]:
    return {
        "session_id": result.session_id,
        "reward": result.reward,
        "num_forks": result.num_forks,
        "trajectories": [
            {"prompt_ids": list(t.prompt_ids), "response_ids": list(t.response_ids),
             "response_mask": list(t.response_mask),
             "response_log_probs": list(t.response_log_probs),
             "global_steps": list(t.global_steps), "num_turns": t.num_turns,
             "stop_reason": t.stop_reason}
            for t in result.trajectories
        ],
    }


@contextlib.asynccontextmanager
async def open_gateway(
    manager: AsyncServerManager,
    *,
    tokenizer: Any,
    model: str,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    chat_template: str | None = None,
    renderer: ChatRenderer | None = None,
    auto_sessions: bool = True,
    max_sessions: int = 4096,
    reply_parser: ReplyParser = assistant_reply,
    allowed_hosts: Sequence[str] = (),
    max_body_bytes: int | None = None,
) -> AsyncIterator[Gateway]:
    """Serve a ``Gateway`` over HTTP for the block's duration.

    Args:
        manager: Where turns are generated.
        tokenizer: A Hugging Face tokenizer, or the folder of one (the model's folder).
        model: The model name clients pass.
        host: Interface to bind; localhost by default (reachable from this machine only).
        port: TCP port; 0 picks a free one (``gateway.url`` tells which).
        api_key: Require ``Authorization: Bearer <api_key>``.
        chat_template: Overrides the tokenizer's chat template.
        renderer: Overrides ``tokenizer`` and ``chat_template`` altogether.
        auto_sessions: Open a session for a request that names none.
        max_sessions: Most open sessions at once.
        reply_parser: Generated text -> reply (Hermes tool calls by default).
        allowed_hosts: ``Host`` names served without an API key besides IP addresses and
            ``localhost`` (``host`` itself is one where it is a name).
        max_body_bytes: The largest request body (see ``Gateway``).

    Raises:
        InvalidRequestError: a bad port.
        OSError: the address is taken or cannot be bound.
    """
    import uvicorn

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidRequestError(f"port must be an int in [0, 65535], not {port!r}")
    if renderer is None:
        renderer = HFChatRenderer(tokenizer if not isinstance(tokenizer, Path) else str(tokenizer),
                                  chat_template=chat_template)
    gateway = Gateway(manager, renderer, model=model, api_key=api_key,
                      auto_sessions=auto_sessions, max_sessions=max_sessions,
                      reply_parser=reply_parser, allowed_hosts=(*allowed_hosts, host),
                      max_body_bytes=max_body_bytes)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
    # without it every reply waited 40 ms on the client's delayed ACK (uvloop sets it anyway).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)  # connections queue here until the server accepts: no start-up wait
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        gateway.url = f"http://{shown}:{bound}"
        config = uvicorn.Config(gateway.app, lifespan="off", log_level="warning",
                                access_log=False, timeout_graceful_shutdown=5)
        server = _server_class()(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="asyncroll-gateway")
        try:
            yield gateway
        finally:
            server.should_exit = True
            await asyncio.shield(serving)
    finally:
        sock.close()

