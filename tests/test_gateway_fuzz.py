"""The gateway never answers a client's bytes with a 5xx: seeded fuzzing of bodies, content types,
sizes, nesting depths, hosts and routes over HTTP, against a ``FakeEngine`` (issue 46, item 4).

Every answer is a 2xx or a 4xx in OpenAI's error format; a refused request reaches no engine; a
conversation running beside the fuzzing goes on unforked.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncroll import AsyncServerManager
from asyncroll.gateway import Gateway, open_gateway
from asyncroll.testing import make_tiny_model
from asyncroll.testing.fake_engine import FakeEngine

CASES = 400
OK: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4}
RESPONSES_OK: dict[str, Any] = {"model": "m", "input": "hi", "max_output_tokens": 4}
TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain",
         "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "",
         "application/jsonx"]
HOSTS = ["127.0.0.1", "localhost:8000", "[::1]:9", "attacker.example", "attacker.example:80",
         "", "127.0.0.1.attacker.example", "LOCALHOST"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fuzz-model"), seed=0)


@pytest.fixture
async def served(model: Path) -> AsyncIterator[tuple[Gateway, FakeEngine]]:
    engine = FakeEngine(vocab_size=512, max_model_len=4096, has_tokenizer=True)
    async with (AsyncServerManager([engine]) as manager,
                open_gateway(manager, tokenizer=model, model="m") as gateway):
        yield gateway, engine


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False, 0, -1, 2**70, 1e308, -0.0, "", "\u0000"])
    if kind == 1:
        return rng.choice([10**400, -(10**400)])  # msgspec decodes these as ints
    if kind == 2:
        return "".join(chr(rng.randrange(0x10FFFF)) for _ in range(rng.randrange(8))).encode(
            "utf-8", "surrogatepass").decode("utf-8", "replace")
    if kind == 3:
        return rng.choice(["user", "assistant", "tool", "system", "developer", "function"])
    if kind == 4:
        return rng.uniform(-3, 3)
    if kind in (5, 6):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["model", "messages", "role", "content", "tools", "tool_choice", "stop", "input",
            "response_format", "type", "function", "name", "arguments", "previous_response_id",
            "reward", "text", "format", "schema", "n", "stream", "temperature", "x"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randrange(5))}


def _nested(depth: int, *, where: str) -> bytes:
    inner = b"[" * depth + b"]" * depth
    if where == "ignored":
        return json.dumps({**OK, "metadata": "X"}).encode().replace(b'"X"', inner)
    if where == "tool":
        tool = {"type": "function", "function": {"name": "f", "parameters": "X"}}
        return json.dumps({**OK, "tools": [tool]}).encode().replace(b'"X"', b"{\"a\":" * depth
                                                                  + b"1" + b"}" * depth)
    return inner


def _body(rng: random.Random, route: str) -> bytes:
    base = RESPONSES_OK if route.endswith("responses") else OK
    choice = rng.randrange(8)
    if choice == 0:  # a valid body with one field replaced
        body = dict(base)
        body[rng.choice([*body, "tools", "stop", "tool_choice", "response_format"])] = \
            _value(rng)
        return json.dumps(body).encode()
    if choice == 1:
        return json.dumps(_value(rng)).encode()
    if choice == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if choice == 3:  # invalid UTF-8 inside a JSON string
        return json.dumps({**base, "user": "X"}).encode().replace(b"X", b"\xff\xfe\xc3")
    if choice == 4:
        return _nested(rng.choice([64, 500, 990, 5000, 100_000]),
                       where=rng.choice(["ignored", "tool", "top"]))
    if choice == 5:
        return b'{"model": "m", "max_tokens": 1' + b"0" * rng.choice([20, 400, 5000]) + b"}"
    if choice == 6:
        return rng.choice([b"", b"null", b"[]", b'""', b"1e400", b'{"model": "m"'])
    return json.dumps(base).encode()


async def test_no_body_content_type_size_depth_or_host_gets_a_5xx(
    served: tuple[Gateway, FakeEngine]
) -> None:
    gateway, engine = served
    rng = random.Random(43)
    kept = gateway.open_session()
    other = gateway.open_session().id
    routes = ["/v1/chat/completions", "/v1/responses", f"/s/{other}/v1/chat/completions",
              f"/s/{other}/v1/responses", f"/sessions/{gateway.open_session().id}/finish",
              "/sessions/nope/finish", "/v1/models"]
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        conversation = [{"role": "user", "content": "beside the fuzz"}]
        for case in range(CASES):
            if case % 50 == 0:  # a conversation goes on beside the fuzzing
                reply = await http.post(f"/s/{kept.id}/v1/chat/completions",
                                        json={**OK, "messages": conversation})
                assert reply.status_code == 200 and reply.json()["asyncroll"]["fork"] is False
                conversation += [reply.json()["choices"][0]["message"],
                                 {"role": "user", "content": f"turn {case}"}]
            route = rng.choice(routes)
            headers = {"content-type": rng.choice(TYPES)}
            if rng.random() < 0.2:
                headers["host"] = rng.choice(HOSTS)
            requests_before = engine.statistics().num_requests
            method = "GET" if route == "/v1/models" else "POST"
            response = await http.request(method, route, content=_body(rng, route),
                                          headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case, route, headers, response.text[:300])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and error["type"] == "invalid_request_error"
                assert engine.statistics().num_requests == requests_before, (case, route)
    assert gateway.statistics().num_failed == 0
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if k >= 400) > 0
    result = await gateway.finish_session(kept.id)
    assert result.num_forks == 0 and result.trajectories[0].num_turns == len(range(0, CASES, 50))


@pytest.mark.parametrize("size", [(1 << 20) + 1, 10 << 20])
async def test_a_body_past_the_limit_is_413_and_never_decoded(
    served: tuple[Gateway, FakeEngine], size: int
) -> None:
    gateway, engine = served
    body = json.dumps({**OK, "user": "x" * size}).encode()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", content=body,
                                   headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == \
            "request_too_large"
        streamed = await http.post("/v1/chat/completions", content=_chunks(body),
                                   headers={"content-type": "application/json"})
        assert streamed.status_code == 413  # no Content-Length: counted as it arrives
    assert engine.statistics().num_requests == 0


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), 1 << 16):
        yield body[start:start + (1 << 16)]


@pytest.mark.parametrize(
    ("reward", "status"),
    [(b"1" + b"0" * 400, 400), (b"1e400", 400), (b'"1"', 400), (b"true", 400), (b"0.5", 200)],
)
async def test_finish_takes_only_a_finite_reward_and_keeps_the_session_otherwise(
    served: tuple[Gateway, FakeEngine], reward: bytes, status: int
) -> None:
    gateway, _ = served
    session = gateway.open_session()
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        response = await http.post(f"/sessions/{session.id}/finish",
                                   content=b'{"reward": ' + reward + b"}",
                                   headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert (gateway.statistics().open_sessions == 1) is (status == 400)


async def test_a_host_that_could_be_rebound_is_refused_without_an_api_key(
    served: tuple[Gateway, FakeEngine], model: Path
) -> None:
    gateway, _ = served
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        evil = await http.get("/v1/models", headers={"host": "attacker.example"})
        assert evil.status_code == 403 and evil.json()["error"]["code"] == "host_not_allowed"
        for host in ("localhost:1", "127.0.0.1", "[::1]:80"):
            assert (await http.get("/v1/models", headers={"host": host})).status_code == 200
    async with (AsyncServerManager([FakeEngine()]) as manager,
                open_gateway(manager, tokenizer=model, model="m", api_key="k",
                             allowed_hosts=["x"]) as keyed,
                httpx.AsyncClient(base_url=keyed.url,
                                  headers={"authorization": "Bearer k"}) as http):
        assert (await http.get("/v1/models", headers={"host": "attacker.example"})
                ).status_code == 200  # a key guards: any host may serve


async def test_replies_leave_at_once_on_plain_asyncio(served: tuple[Gateway, FakeEngine]) -> None:
    """The server's side of a connection has TCP_NODELAY: without it (a listening socket made
    with protocol 0, which asyncio does not take for TCP) each reply's second write waited for
    the client's delayed ACK, 40 ms a request."""
    import asyncio
    import gc
    import socket

    gateway, _ = served
    port = int(gateway.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await reader.readuntil(b"owned_by")
        mine = writer.get_extra_info("sockname")
        (server_side,) = [
            transport.get_extra_info("socket") for transport in gc.get_objects()
            if isinstance(transport, asyncio.Transport) and not transport.is_closing()
            and transport.get_extra_info("peername") == mine]
        assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        writer.close()
        await writer.wait_closed()
