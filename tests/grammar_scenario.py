"""The grammar-compile scenario against a real `kvseal serve` (colocated, or `--pd`), shared by
tests/server/test_grammar_budget.py and tests/disagg/test_pd_structured.py.

Each `check_*` raises AssertionError when what it guards is broken; the tests run every check
on a healthy server, and on a server with the breaking fault switched on, where it must fail.
Nothing here asserts a duration: "B did not wait behind A" is B's request finishing, by the
server's audit records, before either of A's; "the disconnect stopped the compile" is the
cancelled counter moving while the timeout counter does not.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from grammar_schemas import SLOW_SCHEMA, big_schema, small_schema
from processes import LoggedProcess, free_port, kvseal_argv, wait_for

from kvseal.structured.compiler import WALL_CAP_FACTOR
from kvseal.structured.schema import (
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_PROPERTIES,
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
)

BUDGET_S = 2.0  # CPU seconds, far from both schemas' compiles: SLOW_SCHEMA's ~20 s and BIG_SCHEMA's ~0.14 s
# (however long other tests on the host stretch that in wall time: ~1.5 s at the workers' nice 10)
NUM_WORKERS = 2  # per engine (the default)
B_DEADLINE_S = 20.0  # generous: B's request ends long before this on any host (asserted, never timed)
KEYS = {"key-alice": {"tenant": "alice"}, "key-bob": {"tenant": "bob"}, "key-carol": {"tenant": "carol"},
        "key-ops": {"tenant": "ops", "admin": True}}
FLAGS = ["--dtype", "float32", "--kv-cache-tokens", "2048", "--page-size", "4", "--max-model-len", "1024",
         "--max-num-batched-tokens", "256", "--tool-call-parser", "hermes",
         "--grammar-compile-timeout-s", f"{BUDGET_S:g}"]
REQUEST_TIMEOUT_S = 120.0


class GrammarServer(LoggedProcess):
    """`kvseal serve` over the character-level model with a short grammar budget."""

    def __init__(self, model_dir: Path, workdir: Path, *, pd: bool, faults: list[str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.model_name = model_dir.name
        self.num_engines = 2 if pd else 1
        keys_path = workdir / "keys.json"
        keys_path.write_text(json.dumps(KEYS))
        args = ["serve", "--model", str(model_dir), "--port", str(self.port), "--api-keys", str(keys_path), *FLAGS,
                *(["--pd"] if pd else [])]
        super().__init__("the server", kvseal_argv(args, faults), workdir / "server.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GrammarServer:
        self.spawn()
        try:
            self.wait_until_healthy(self.url)
        except AssertionError:
            self.kill()
            raise
        return self

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=_auth("key-ops"), timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise AssertionError(f"metric {name} not in /metrics")

    def chat(self, key: str, timeout_s: float = REQUEST_TIMEOUT_S, **fields: Any) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=self.chat_body(**fields), headers=_auth(key),
                          timeout=timeout_s)

    def chat_body(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32,
                "temperature": 0} | fields

    def wait_idle_and_ready(self) -> None:
        """No compile runs or waits, and every engine has all its grammar workers (the pool
        starts at the first structured request; a stopped worker is replaced)."""
        self.chat("key-ops", response_format=schema_format(small_schema()))
        wait_for(lambda: self.metric("kvseal_grammar_compiles_running") == 0
                 and self.metric("kvseal_grammar_compiles_queued") == 0, "no grammar compile to run")
        wait_for(lambda: self.metric("kvseal_grammar_workers_ready") == NUM_WORKERS * self.num_engines,
                 "every grammar worker to be ready", 180)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, (response.status_code, response.text[:500])
    error: dict[str, Any] = response.json()["error"]
    return error


# ---- tenant B's small grammar does not wait behind tenant A's ------------------------------

def check_b_not_behind_a(server: GrammarServer) -> tuple[float, float]:
    """A sends an over-budget schema, then a huge-but-allowed one; B's small schema is
    answered before either of A's requests ends (the server's audit records say in which order
    they finished: a client-side check of A's requests when B's answer arrives raced with the
    threads that wait for them). Then A's over-budget one is a 400
    naming the limit and the flag, its big one is served, and A's next grammar compiles (the
    stopped worker was replaced). Returns B's wall time alone and while A's compile ran
    (reported, never asserted)."""
    server.wait_idle_and_ready()
    started_s = time.monotonic()
    assert server.chat("key-bob", response_format=schema_format(small_schema())).status_code == 200
    alone_s = time.monotonic() - started_s
    with ThreadPoolExecutor(2) as executor:  # A's requests end right after their compiles (one token)
        slow = executor.submit(server.chat, "key-alice", response_format=schema_format(SLOW_SCHEMA), max_tokens=1)
        wait_for(lambda: server.metric("kvseal_grammar_compiles_running") >= 1, "A's compile to start")
        big = executor.submit(server.chat, "key-alice", response_format=schema_format(big_schema()), max_tokens=1)
        wait_for(lambda: _num_compiles(server) >= 2, "A's second grammar to reach the compile pool")
        waited_s, b_answer = _b_request(server, slow, big)
        slow_answer, big_answer = slow.result(), big.result()
    finished_at = _finish_times(server, [slow_answer, big_answer, b_answer])
    assert finished_at[2] < min(finished_at[:2]), f"tenant B's grammar waited behind tenant A's: {finished_at}"
    error = error_of(slow_answer)
    assert (error["code"], error["param"]) == ("grammar_compile_timeout", "response_format"), error
    assert f"{BUDGET_S:g} s" in error["message"] and "--grammar-compile-timeout-s" in error["message"], error
    assert big_answer.status_code == 200, big_answer.text[:500]
    assert server.metric("kvseal_grammar_compile_timeouts") >= 1
    assert server.chat("key-alice", response_format=schema_format(small_schema())).status_code == 200
    return alone_s, waited_s


def _num_compiles(server: GrammarServer) -> float:
    return server.metric("kvseal_grammar_compiles_running") + server.metric("kvseal_grammar_compiles_queued")


def _b_request(server: GrammarServer, slow: Future[httpx.Response], big: Future[httpx.Response]
               ) -> tuple[float, httpx.Response]:
    """B's request: (its wall time, its answer)."""
    started_s = time.monotonic()
    answer = server.chat("key-bob", timeout_s=B_DEADLINE_S, response_format=schema_format(small_schema()))
    waited_s = time.monotonic() - started_s
    assert answer.status_code == 200, answer.text[:500]
    choice = answer.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert set(json.loads(choice["message"]["content"])) == {"ok"}
    return waited_s, answer


def _finish_times(server: GrammarServer, answers: list[httpx.Response]) -> list[float]:
    """When the server finished each answered request, from its audit lines (the server log
    holds them: no --audit-log), which are written before the answer is sent."""
    wanted = [answer.headers["x-request-id"] for answer in answers]
    found: dict[str, float] = {}
    for line in server.log().splitlines():
        _, marker, record = line.partition("kvseal.audit: ")
        if marker and record.startswith("{"):
            fields = json.loads(record)
            if fields.get("request_id") in wanted:
                found[fields["request_id"]] = fields["finished_at"]
    assert set(found) == set(wanted), f"audit lines missing for {set(wanted) - set(found)}"
    return [found[request_id] for request_id in wanted]


# ---- a client that leaves stops its compile ------------------------------------------------

def check_disconnect_cancels_the_compile(server: GrammarServer) -> None:
    """A client sends an over-budget schema and leaves while it compiles: the compile is
    stopped as cancelled (the timeout counter does not move) and the pool is idle again."""
    server.wait_idle_and_ready()
    cancelled, timeouts = (server.metric("kvseal_grammar_compiles_cancelled"),
                           server.metric("kvseal_grammar_compile_timeouts"))
    body = json.dumps(server.chat_body(response_format=schema_format(SLOW_SCHEMA))).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-carol\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + body)
        wait_for(lambda: server.metric("kvseal_grammar_compiles_running") >= 1, "the compile to start")

    def ended() -> tuple[float, float] | None:
        now = (server.metric("kvseal_grammar_compiles_cancelled"), server.metric("kvseal_grammar_compile_timeouts"))
        return now if now != (cancelled, timeouts) else None

    after = wait_for(ended, "the compile to be stopped", BUDGET_S * WALL_CAP_FACTOR + 60)
    assert after == (cancelled + 1, timeouts), f"(cancelled, timeouts) went from {(cancelled, timeouts)} to {after}"
    wait_for(lambda: server.metric("kvseal_grammar_compiles_running") == 0, "no compile to run")


# ---- tools pass response_format's door checks ----------------------------------------------

def _too_big() -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"type": "string", "description": "x" * MAX_SCHEMA_CHARS}}}


def _too_deep() -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    return schema


def _too_many_properties() -> dict[str, Any]:
    """Over the property limit, within the size limit."""
    schema = {"type": "object", "properties": {str(i): {} for i in range(MAX_SCHEMA_PROPERTIES + 1)}}
    assert len(json.dumps(schema)) <= MAX_SCHEMA_CHARS
    return schema


OVER_LIMIT_SCHEMAS = {"size": (_too_big, f"the limit is {MAX_SCHEMA_CHARS}"),
                      "depth": (_too_deep, f"the limit is {MAX_SCHEMA_DEPTH}"),
                      "properties": (_too_many_properties, f"the limit is {MAX_SCHEMA_PROPERTIES}")}


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def check_tools_refused_like_response_format(server: GrammarServer, limit: str) -> None:
    """A schema over one door limit is refused the same way as response_format and as a tool's
    parameters (whatever tool_choice), naming the same limit."""
    schema, limit_text = OVER_LIMIT_SCHEMAS[limit]
    answers = {"response_format": server.chat("key-alice", response_format=schema_format(schema()))}
    for choice in ("required", "auto"):
        answers[f"tools/{choice}"] = server.chat("key-alice", tools=[_tool("f", schema())], tool_choice=choice)
    for how, answer in answers.items():
        error = error_of(answer)
        assert error["code"] == "invalid_parameter" and limit_text in error["message"], (how, error)
        assert error["param"] == how.partition("/")[0], (how, error)


def check_tool_count_is_bounded(server: GrammarServer) -> None:
    """More tools than `MAX_TOOLS` are a 400 naming the limit (the request body's own bound)."""
    many = [_tool(f"f{i}", {"type": "object"}) for i in range(MAX_TOOLS + 1)]
    error = error_of(server.chat("key-alice", tools=many, tool_choice="auto"))
    assert error["param"] == "tools" and f"at most {MAX_TOOLS}" in error["message"], error


def check_tools_total_is_bounded(server: GrammarServer) -> None:
    """Tools within the per-schema limit but too big together are a 400 naming the limit."""
    big_enough = {"type": "object", "description": "x" * (MAX_SCHEMA_CHARS - 100)}
    error = error_of(server.chat("key-alice", tools=[_tool(f"f{i}", big_enough) for i in range(5)],
                                 tool_choice="auto"))
    assert error["param"] == "tools" and f"the limit is {MAX_TOOLS_CHARS}" in error["message"], error
