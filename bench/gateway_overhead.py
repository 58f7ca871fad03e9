"""What the OpenAI gateway adds to a turn, against calling the manager directly (target < 1 ms).

One process, one uvloop event loop: the gateway (uvicorn + FastAPI) and its client (httpx, as
the ``openai`` client uses) run together, as with ``GatewaySource``; the engine is an instant
``FakeEngine`` (16 tokens, no generation time), so every microsecond measured is overhead. Each
conversation is a system prompt, a user turn, then ``--turns`` turns, each followed by a new
user message, so prompts grow as in a real multi-turn agent.

Paths, run alternately ``--repeats`` times (the median of each is reported, per turn):
- ``manager``: ``manager.generate`` with the same prompts as token ids (the baseline);
- ``gateway.chat``: the gateway's own work without HTTP (check, render, tokenize the suffix,
  generate, parse, record);
- ``HTTP floor``: an empty JSON POST to a FastAPI route on the same server (what any HTTP
  gateway in Python pays: the physical floor of this design);
- ``gateway HTTP``: the real ``POST /v1/chat/completions``;
- ``responses HTTP``: the real ``POST /v1/responses``, each turn sending the conversation's
  items back (as openai-agents does);
- ``plain /v1``: chat completions on the plain base URL, each turn's session found by its
  content (``asyncroll.gateway.matching``) among the ``--sessions`` conversations.
The gateway's added latency is ``gateway HTTP - manager`` (and the same for the other two);
the report also gives it as a multiple of the HTTP floor.

    .venv/bin/python bench/gateway_overhead.py [--sessions 100] [--turns 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import uvloop
from fastapi import Request
from fastapi.responses import JSONResponse

from asyncroll import AsyncServerManager
from asyncroll.gateway import Gateway, open_gateway
from asyncroll.testing import make_tiny_model
from asyncroll.testing.fake_engine import FakeEngine

TARGET_MS = 1.0
SYSTEM = "You are a helpful assistant. Answer the question, call a tool when it helps."
PARAMS: dict[str, Any] = {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True}


def _conversations(sessions: int, turns: int) -> list[list[str]]:
    return [[f"Question {s}: what is {s} plus {t}?" for t in range(turns)]
            for s in range(sessions)]


async def _via_http(http: httpx.AsyncClient, gateway: Gateway, users: list[str]) -> None:
    session = gateway.open_session()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for user in users:
        messages.append({"role": "user", "content": user})
        response = await http.post(f"/s/{session.id}/v1/chat/completions",
                                   json={"model": "m", "messages": messages, **PARAMS})
        messages.append(response.json()["choices"][0]["message"])
    await gateway.finish_session(session.id)


async def _via_responses(http: httpx.AsyncClient, gateway: Gateway, users: list[str]) -> None:
    session = gateway.open_session()
    items: list[dict[str, Any]] = []
    for user in users:
        items.append({"role": "user", "content": user})
        response = await http.post(f"/s/{session.id}/v1/responses", json={
            "model": "m", "instructions": SYSTEM, "input": items, "max_output_tokens": 16,
            "temperature": 1.0})
        items += response.json()["output"]
    await gateway.finish_session(session.id)


async def _via_plain_url(http: httpx.AsyncClient, conversations: list[list[str]]) -> list[str]:
    """Every conversation's turns in turn on the plain URL (each found among all of them)."""
    histories: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": SYSTEM}] for _ in conversations]
    sessions = set()
    for turn in range(len(conversations[0])):
        for users, messages in zip(conversations, histories, strict=True):
            messages.append({"role": "user", "content": users[turn]})
            response = await http.post("/v1/chat/completions", json={
                "model": "m", "messages": messages, **PARAMS})
            messages.append(response.json()["choices"][0]["message"])
            sessions.add(response.headers["x-session-id"])
    assert len(sessions) == len(conversations), "a conversation did not find its session"
    return sorted(sessions)


async def _via_chat(gateway: Gateway, users: list[str]) -> None:
    session = gateway.open_session()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for user in users:
        messages.append({"role": "user", "content": user})
        body = json.loads(json.dumps({"model": "m", "messages": messages, **PARAMS}))
        *_, reply, _ = await gateway.chat(body, session_id=session.id)
        messages.append(reply.message())
    await gateway.finish_session(session.id)


async def _via_manager(manager: AsyncServerManager, prompts: list[list[int]], key: str) -> None:
    for turn, prompt in enumerate(prompts):
        await manager.generate(f"{key}/{turn}", prompt_ids=prompt, sampling_params=PARAMS,
                               session_key=key)


async def _floor(http: httpx.AsyncClient, users: list[str]) -> None:
    for user in users:
        (await http.post("/bench/echo", json={"user": user})).json()


async def _timed(run: Callable[[], Awaitable[None]], turns: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    await run()
    return ((time.perf_counter() - wall) / turns * 1e3, (time.thread_time() - cpu) / turns * 1e3)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    conversations = _conversations(args.sessions, args.turns)
    turns = args.sessions * args.turns
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "m", seed=0)
        engine = FakeEngine(vocab_size=512, max_model_len=4096)
        async with (AsyncServerManager([engine]) as manager,
                    open_gateway(manager, tokenizer=model, model="m") as gateway):

            async def echo(request: Request) -> JSONResponse:
                return JSONResponse({"ok": await request.json()})

            gateway.app.add_api_route("/bench/echo", echo, methods=["POST"])
            # The manager path's prompts: what the gateway would send, rendered beforehand.
            prompts = []
            for users in conversations:
                messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
                rendered = []
                for user in users:
                    messages.append({"role": "user", "content": user})
                    rendered.append(gateway.renderer.encode(gateway.renderer.render(messages,
                                                                                   None)))
                    messages.append({"role": "assistant", "content": "x" * 16})
                prompts.append(rendered)
            async with httpx.AsyncClient(base_url=gateway.url) as http:
                paths: dict[str, Callable[[], Awaitable[None]]] = {}

                async def manager_path() -> None:
                    for s, session_prompts in enumerate(prompts):
                        await _via_manager(manager, session_prompts, f"m{time.perf_counter()}{s}")

                async def chat_path() -> None:
                    for users in conversations:
                        await _via_chat(gateway, users)

                async def floor_path() -> None:
                    for users in conversations:
                        await _floor(http, users)

                async def http_path() -> None:
                    for users in conversations:
                        await _via_http(http, gateway, users)

                async def responses_path() -> None:
                    for users in conversations:
                        await _via_responses(http, gateway, users)

                async def plain_path() -> None:
                    for session_id in await _via_plain_url(http, conversations):
                        await gateway.finish_session(session_id)

                paths = {"manager": manager_path, "gateway.chat": chat_path,
                         "HTTP floor": floor_path, "gateway HTTP": http_path,
                         "responses HTTP": responses_path, "plain /v1": plain_path}
                for run in paths.values():  # warm-up
                    await run()
                samples: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
                for _ in range(args.repeats):
                    for name, run in paths.items():
                        samples[name].append(await _timed(run, turns))
    wall = {name: statistics.median(w for w, _ in values) for name, values in samples.items()}
    cpu = {name: statistics.median(c for _, c in values) for name, values in samples.items()}
    added = wall["gateway HTTP"] - wall["manager"]
    added_by = {name: wall[name] - wall["manager"]
                for name in ("gateway HTTP", "responses HTTP", "plain /v1")}
    return {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "versions": {p: version(p) for p in ("fastapi", "uvicorn", "httpx", "transformers")},
        "sessions": args.sessions, "turns_per_session": args.turns, "repeats": args.repeats,
        "ms_per_turn_wall": wall, "ms_per_turn_cpu": cpu,
        "gateway_added_ms": added,
        "gateway_added_ms_by_path": added_by,
        "gateway_added_over_http_floor": added / wall["HTTP floor"],
        "target_ms": TARGET_MS, "target_met": max(added_by.values()) < TARGET_MS,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the result here")
    arguments = parser.parse_args()
    result = uvloop.run(main(arguments))
    for name, ms in result["ms_per_turn_wall"].items():
        print(f"{name:>13}: {ms:7.3f} ms/turn wall, {result['ms_per_turn_cpu'][name]:7.3f} ms CPU")
    print(f"gateway adds {result['gateway_added_ms']:.3f} ms per turn over the manager "
          f"({result['gateway_added_over_http_floor']:.2f}x the bare HTTP round trip); "
          + ", ".join(f"{name} {ms:.3f} ms" for name, ms
                      in result["gateway_added_ms_by_path"].items())
          + f"; target < {TARGET_MS} ms: {'met' if result['target_met'] else 'NOT met'}")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(result, indent=2) + "\n")
