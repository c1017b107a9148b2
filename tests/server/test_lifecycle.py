"""Process lifecycle: SIGTERM drains and exits 0; a dead engine gives errors and 503, never a hang.

Each test starts its own server without an API keys file (the single tenant `default`), but
for the two that leave theirs as they found it (`kept_server`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from processes import WAIT_DEADLINE_S, free_port, process_gone, wait_for
from server_process import ServerProcess, client_for

BODY = {"prompt": "w5 w6", "max_tokens": 300, "ignore_eos": True, "stream": True}


@pytest.fixture
def start_server(server_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*extra_args: str, own_process_group: bool = False, faults: list[str] | None = None) -> ServerProcess:
        started.append(ServerProcess(server_model_dir, tmp_path / str(len(started)), extra_args=list(extra_args),
                                     own_process_group=own_process_group, faults=faults))
        return started[-1].start()

    yield start
    for proc in started:
        proc.stop()  # SIGTERM (then SIGKILL): the server removes its engine's socket folder


def _events(lines: Iterator[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_sigterm_lets_in_flight_requests_finish_then_exits_zero(start_server: Callable[..., ServerProcess]) -> None:
    open_server = start_server("--shutdown-grace-s", "120", "--audit-log-prompts")
    with httpx.stream("POST", f"{open_server.base_url}/completions", json=BODY, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        assert open_server.proc is not None
        open_server.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
        request_id = response.headers["x-request-id"]
    assert rest[-2:] == ["data: [DONE]", ""]
    assert json.loads(rest[-4][6:])["choices"][0]["finish_reason"] == "length"
    assert open_server.terminate() == 0
    record = open_server.audit_for(request_id)
    assert record["outcome"] == "finished" and record["tenant"] == "default"
    assert record["prompt"] == BODY["prompt"]  # --audit-log-prompts
    log = open_server.log()
    assert "kvseal ready" in log and "shutting down" in log and "Traceback" not in log
    # both processes took their start-up heap out of garbage collection (kvseal/heap.py)
    assert "frontend: " in log and "engine: " in log and log.count("start-up objects frozen") == 2
    # the engine process reserved its KV pool before it imported torch, and adopted it
    # (kvseal/kvcache/reserve.py; not where a GPU device node makes --device auto undecided)
    gpu_node = any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd"))
    assert f"kv_pool_reserved_early={not gpu_node}" in log
    assert '"POST /v1/completions HTTP/1.1" 200' in log  # uvicorn's access line, at INFO


def test_vllms_flags_are_taken_with_a_line_each_and_uvicorns_log_level_applies(
        start_server: Callable[..., ServerProcess]) -> None:
    quiet_server = start_server("--uvicorn-log-level", "warning", "--trust-remote-code", "--disable-log-requests")
    with client_for(quiet_server, "EMPTY") as client:
        completion = client.completions.with_raw_response.create(model=quiet_server.model_name, prompt="w5",
                                                                  max_tokens=2)
    assert quiet_server.terminate() == 0
    log = quiet_server.log()
    assert "vLLM's --trust-remote-code is taken and changes nothing" in log
    assert "vLLM's --disable-log-requests is taken and changes nothing" in log
    assert "POST /v1/completions" not in log  # no access line at WARNING
    assert quiet_server.audit_for(completion.headers["x-request-id"])["outcome"] == "finished"  # the audit line stays


def _stream_then_sigterm(open_server: ServerProcess) -> tuple[list[str], str]:
    """A long stream, and SIGTERM once its first event is in: the stream's remaining lines."""
    with httpx.stream("POST", f"{open_server.base_url}/completions", json=BODY | {"max_tokens": 500},
                      timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        assert open_server.proc is not None
        open_server.proc.send_signal(signal.SIGTERM)
        return list(lines), response.headers["x-request-id"]


def _ends_in_an_abort_error(rest: list[str]) -> bool:
    """I6: an aborted stream ends with an error event, then `[DONE]`; no chunk claims a finish."""
    events = _events(iter(rest))
    error = events[-1].get("error", {}) if events else {}
    return (error.get("code") == "engine_unavailable" and "shutting down" in error.get("message", "")
            and rest[-2:] == ["data: [DONE]", ""]
            and not any(c.get("choices", [{}])[0].get("finish_reason") for c in events[:-1]))


def test_sigterm_past_the_grace_period_aborts_with_an_error(start_server: Callable[..., ServerProcess]) -> None:
    open_server = start_server("--shutdown-grace-s", "0")
    rest, request_id = _stream_then_sigterm(open_server)
    assert _ends_in_an_abort_error(rest)
    assert open_server.terminate() == 0
    record = open_server.audit_for(request_id)
    assert record["outcome"] == "aborted" and record["reason"] == "server_shutdown"


def test_the_abort_check_fails_when_an_abort_is_served_as_a_success(
        start_server: Callable[..., ServerProcess]) -> None:
    """The negative control of the test above (I6): a frontend that passes an abort off as a
    finished answer ends the stream with a chunk that claims a finish and no error."""
    open_server = start_server("--shutdown-grace-s", "0", faults=["abort_as_success"])
    rest, _ = _stream_then_sigterm(open_server)
    assert not _ends_in_an_abort_error(rest)
    assert rest[-2:] == ["data: [DONE]", ""] and not any('"error"' in line for line in rest)
    open_server.terminate()


def test_engine_death_fails_requests_and_health(start_server: Callable[..., ServerProcess]) -> None:
    open_server = start_server("--engine-restart-limit", "0")  # restarts: tests/server/test_engine_restart.py
    # the pool's real figures from start-up, before any request (the canary's "before the run")
    assert open_server.metric("kvseal_kv_pages_free") > 0 and open_server.metric("kvseal_kv_pages_used") == 0
    client = client_for(open_server, "EMPTY")
    out = client.completions.create(model=open_server.model_name, prompt="w5", max_tokens=2)
    assert open_server.audit_for(out.id)["tenant"] == "default"
    wait_for(lambda: 'kvseal_requests_total{outcome="finished",tenant="default"} 1.0' in
             httpx.get(f"{open_server.url}/metrics").text, "the request in /metrics")
    with httpx.stream("POST", f"{open_server.base_url}/completions", json=BODY | {"max_tokens": 500},
                      timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        os.kill(open_server.engine_pid, signal.SIGKILL)
        events = _events(lines)
        request_id = response.headers["x-request-id"]
    assert events[-1]["error"]["code"] == "engine_unavailable"
    assert "exited unexpectedly" in events[-1]["error"]["message"]
    health = httpx.get(f"{open_server.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    # with --engine-restart-limit 0 the engine stays down, and the 503 says to restart the server
    # (retrying cannot help); the restarts themselves: tests/server/test_engine_restart.py
    message = health.json()["error"]["message"]
    assert "not restarted (--engine-restart-limit 0): restart the server" in message
    assert "Retry later" not in message
    assert "CRITICAL" in open_server.log() and "restarting the engine (pid" not in open_server.log()
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=open_server.model_name, prompt="w5")
    assert info.value.status_code == 503
    with pytest.raises(openai.APIError):  # a stream in flight or a new one: an error, never a hang
        list(client.chat.completions.create(model=open_server.model_name, stream=True,
                                            messages=[{"role": "user", "content": "w5"}]))
    assert open_server.audit_for(request_id)["outcome"] == "error"
    assert open_server.metric("kvseal_engine_up") == 0
    for stale in ("kvseal_kv_pages_used", "kvseal_kv_pages_free", "kvseal_num_requests_running"):
        assert open_server.metric(stale) == 0, stale  # the dead engine's last figures are not reported
    assert open_server.terminate() == 0



def test_sigterm_to_the_whole_process_group_drains_too(start_server: Callable[..., ServerProcess]) -> None:
    """systemd's KillMode=control-group, `kill -TERM -PGID`, `tini -g`: the engine gets SIGTERM
    too, ignores it, and the frontend drains as usual; meanwhile new connections get 503."""
    # The engine is held (SIGSTOP) from before the request until the probe got its 503, so the
    # request is in flight when the drain begins and the drain cannot end before the probe asks,
    # however loaded or idle the host (sizing the response failed under load once, and on an idle
    # host the tiny model ran all of it before a stop sent at its first event). The stream's
    # headers come once the request is submitted. A stopped process keeps the group's SIGTERM
    # pending; it meets the engine's handler when the engine goes on.
    group_server = start_server("--shutdown-grace-s", "120", own_process_group=True)
    assert group_server.proc is not None
    engine_pid = group_server.engine_pid
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        with (httpx.Client(timeout=30, headers={"Connection": "close"}) as probes,
              httpx.stream("POST", f"{group_server.base_url}/completions", json=BODY, timeout=60) as response):
            os.killpg(group_server.proc.pid, signal.SIGTERM)
            refused = wait_for(lambda: _status_while_draining(group_server, probes), "a 503 while draining")
            os.kill(engine_pid, signal.SIGCONT)
            rest = list(response.iter_lines())
            request_id = response.headers["x-request-id"]
    finally:
        with contextlib.suppress(ProcessLookupError):  # never left stopped; gone already once drained
            os.kill(engine_pid, signal.SIGCONT)
    assert refused == 503
    assert rest[-2:] == ["data: [DONE]", ""]
    assert json.loads(rest[-4][6:])["choices"][0]["finish_reason"] == "length"
    assert group_server.terminate() == 0
    assert group_server.audit_for(request_id)["outcome"] == "finished"
    assert "exited unexpectedly" not in group_server.log()


def test_a_second_sigterm_while_the_engine_stops_is_ignored_and_the_socket_folder_goes(
        start_server: Callable[..., ServerProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """Once uvicorn has stopped, the frontend stops its engine (a message, then a bounded wait) and
    removes the engine's socket folder. A SIGTERM then (a supervisor that signals twice, a
    second Ctrl-C) is logged and ignored: with the signal's default action the frontend died
    there and the folder was left. The engine is held (SIGSTOP) so the stop lasts."""
    # A short folder (an IPC socket's path must fit 107 bytes; tmp_path under xdist is too long)
    sockets = Path(tempfile.mkdtemp(prefix="s", dir=os.environ["TMPDIR"]))
    monkeypatch.setenv("TMPDIR", str(sockets))
    server = start_server()
    assert server.proc is not None and len(list(sockets.glob("kvseal-*"))) == 1
    engine_pid = server.engine_pid
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "Finished server process" in server.log(), "uvicorn to stop serving")
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: _running_and_logged(server, "SIGTERM while the engines stop: already stopping"),
                 "the second SIGTERM to be logged")
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert server.terminate() == 0
    wait_for(lambda: process_gone(engine_pid), "the engine process to exit")
    assert not list(sockets.glob("kvseal-*")), "the engine's socket folder is removed"
    assert "Traceback" not in server.log()


def _running_and_logged(server: ServerProcess, line: str) -> bool:
    server.assert_running()  # fails at once, with the log, where the signal ended it
    return line in server.log()


def _status_while_draining(server: ServerProcess, client: httpx.Client) -> int | None:
    """A new connection's answer once draining began (None before). The request is one the door
    refuses (400) without the engine, which the caller holds: the shutdown check comes first."""
    response = client.post(f"{server.base_url}/completions", json={"prompt": "w5", "max_tokens": -1})
    if response.status_code == 400:
        return None
    assert response.json()["error"]["code"] == "engine_unavailable"
    return response.status_code


@pytest.fixture(scope="module")
def kept_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the tests that leave it as they found it (serving, its children unchanged):
    short header and body timeouts, and the leader of its own process group."""
    proc = ServerProcess(server_model_dir, tmp_path_factory.mktemp("kept"), own_process_group=True,
                         extra_args=["--header-timeout-s", "1", "--body-timeout-s", "1"]).start()
    yield proc
    proc.stop()


def test_slow_clients_are_timed_out(kept_server: ServerProcess) -> None:
    slow_server = kept_server  # --header-timeout-s 1 --body-timeout-s 1
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=WAIT_DEADLINE_S) as partial_headers:
        partial_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert partial_headers.recv(1024) == b""  # closed by the server, not by this test's deadline
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=WAIT_DEADLINE_S) as partial_body:
        partial_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: 100\r\n\r\n{\"prompt\": ")
        answer = _read_http_response(partial_body)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=WAIT_DEADLINE_S) as kept_alive:
        kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_http_response(kept_alive).startswith(b"HTTP/1.1 200")
        kept_alive.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the next request stalls
        assert kept_alive.recv(1024) == b""  # its headers are timed out as a first request's are
    assert httpx.get(f"{slow_server.url}/health", timeout=10).status_code == 200



def test_connections_past_the_cap_are_answered_503_and_held_ones_take_no_more(
        start_server: Callable[..., ServerProcess]) -> None:
    """Clients holding connections open (headers sent slowly) cost others new connections while
    they hold them, never the file descriptors the engine links and the audit log need."""
    capped = start_server("--max-connections", "4", "--header-timeout-s", "60")
    assert "max_connections=4 (open files allowed: " in capped.log()
    held = [socket.create_connection(("127.0.0.1", capped.port), timeout=WAIT_DEADLINE_S) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers that never end
        wait_for(lambda: _health_status(capped) == 503, "a connection past the cap to be refused")
        with socket.create_connection(("127.0.0.1", capped.port), timeout=WAIT_DEADLINE_S) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = _read_http_response(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: _health_status(capped) == 200, "the server to take connections again")
    with client_for(capped, "EMPTY") as client:
        assert client.completions.create(model=capped.model_name, prompt="w5", max_tokens=2).choices[0].text
    assert capped.terminate() == 0


def _health_status(server: ServerProcess) -> int:
    return httpx.get(f"{server.url}/health", timeout=WAIT_DEADLINE_S).status_code

def _read_http_response(sock: socket.socket) -> bytes:
    """One whole HTTP response (headers and a content-length body), however it is split into
    segments; bounded by the socket's timeout."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_engine_exits_when_the_frontend_is_killed(start_server: Callable[..., ServerProcess]) -> None:
    """The orphaned engine stops, and removes the socket folder its SIGKILLed frontend cannot."""
    folders_before = set(Path(tempfile.gettempdir()).glob("kvseal-*"))
    open_server = start_server()
    engine_pid = open_server.engine_pid
    [folder] = set(Path(tempfile.gettempdir()).glob("kvseal-*")) - folders_before
    assert (folder / "from_engine").exists()
    open_server.kill()
    wait_for(lambda: process_gone(engine_pid), "the orphaned engine process to exit")
    assert not folder.exists(), "the engine removes the socket folder when its frontend is gone"


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvseal.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=WAIT_DEADLINE_S * 3)


def test_a_configuration_the_engine_cannot_honour_stops_start_up(server_model_dir: Path) -> None:
    done = _serve("--model", str(server_model_dir), "--dtype", "float32", "--max-model-len", "512",
                  "--kv-cache-tokens", "256", "--page-size", "4")
    assert done.returncode == 2
    assert "kvseal: error: ConfigError" in done.stderr and "512" in done.stderr and "256" in done.stderr
    assert "kvseal ready" not in done.stderr


def test_a_bad_keys_file_stops_start_up(server_model_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text('{"super-secret": {"tenant": ""}}')
    done = _serve("--model", str(server_model_dir), "--api-keys", str(keys))
    assert done.returncode == 2 and "tenant" in done.stderr and "super-secret" not in done.stderr
    assert "kvseal[engine]" not in done.stderr, "the keys are read before any engine starts"


def test_vllms_api_key_flag_and_variable_are_refused_never_echoed(server_model_dir: Path) -> None:
    """`--api-key KEY` would be argparse's abbreviation of `--api-keys` (the key reported back as
    a file it cannot read); VLLM_API_KEY, which kvseal does not read, would leave the server open.
    Both stop start-up before any engine runs, and the key appears nowhere."""
    done = _serve("--model", str(server_model_dir), "--api-key", "sk-secret-123")
    assert done.returncode == 2 and "--api-keys FILE" in done.stderr and "sk-secret-123" not in done.stderr
    env = {**os.environ, "VLLM_API_KEY": "sk-secret-456"}
    done = subprocess.run([sys.executable, "-m", "kvseal.cli", "serve", "--port", str(free_port()), "--model",
                           str(server_model_dir)], capture_output=True, text=True, timeout=WAIT_DEADLINE_S, env=env)
    assert done.returncode == 2 and "VLLM_API_KEY is set, but kvseal does not read it" in done.stderr
    assert "sk-secret-456" not in done.stderr and "kvseal[engine]" not in done.stderr


def test_a_chat_template_that_names_no_file_stops_start_up_before_the_engine(server_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    done = _serve("--model", str(server_model_dir), "--chat-template", str(tmp_path / "missing.jinja"))
    assert done.returncode == 2 and "--chat-template" in done.stderr and "names no readable file" in done.stderr
    assert "kvseal[engine]" not in done.stderr, "the template is read before any engine starts"


def test_a_chat_template_that_renders_nothing_stops_start_up(server_model_dir: Path) -> None:
    """A template that renders no conversation (an unclosed for) is found once the tokenizer is
    loaded, and the server never serves (the reasoning parser's markers are checked there too)."""
    done = _serve("--model", str(server_model_dir), "--dtype", "float32", "--kv-cache-tokens", "256",
                  "--max-model-len", "128", "--chat-template", "{% for m in messages %}{{ m['content'] }}")
    assert done.returncode == 2 and "--chat-template cannot render" in done.stderr, done.stderr[-3000:]
    assert "kvseal ready" not in done.stderr


def _spawned_engine(frontend_pid: int) -> int | None:
    """The frontend's engine child (multiprocessing's spawn_main; its other child is the resource
    tracker), or None while it has none."""
    children = Path(f"/proc/{frontend_pid}/task/{frontend_pid}/children").read_text().split()
    for child in map(int, children):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    return None


def test_a_sigterm_while_the_server_starts_leaves_no_engine_and_no_socket_folder(server_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    """The colocated engine process starts before the frontend loads FastAPI and transformers. A
    SIGTERM as soon as that process exists (the frontend still loading) stops the server, the
    engine with it, and the engine's socket folder (created under TMPDIR) is removed."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with (tmp_path / "server.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvseal.cli", "serve", "--port", str(free_port()),
                                 "--model", str(server_model_dir), "--dtype", "float32"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        engine_pid = wait_for(lambda: proc.poll() is None and _spawned_engine(proc.pid), "the engine process")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_DEADLINE_S) in (0, 128 + signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: process_gone(engine_pid), "the engine process to exit with its frontend")
    assert not list(tmp_path.glob("kvseal-*")), "the engine's socket folder is removed"
    assert "kvseal ready" not in (tmp_path / "server.log").read_text()


def test_an_address_that_cannot_be_listened_on_stops_start_up_before_the_engine(server_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """A port another socket holds: `kvseal: error:` naming the address, exit 2, before any engine
    started (uvicorn used to fail only after the model loaded, exit 3, with no such line)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kvseal.cli", "serve", "--port", str(port), "--model",
                               str(server_model_dir), "--dtype", "float32"],
                              capture_output=True, text=True, env=env, timeout=WAIT_DEADLINE_S * 3)
    assert done.returncode == 2, done.stderr
    assert f"kvseal: error: cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "kvseal[engine]" not in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.glob("kvseal-*")), "no engine started, so no socket folder"


@pytest.mark.parametrize("host", ["999.1.1.1", "::1.2"])
def test_a_host_that_does_not_resolve_stops_start_up(host: str, server_model_dir: Path) -> None:
    done = _serve("--model", str(server_model_dir), "--host", host)
    assert done.returncode == 2, done.stderr
    assert f"kvseal: error: cannot listen on {host}:" in done.stderr and "kvseal[engine]" not in done.stderr


def _descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`: its state letter ('Z' for <defunct>), by PID."""
    found: dict[int, str] = {}
    parents = {pid}
    while parents:
        children = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) in parents:
                    children[int(stat.parent.name)] = fields[0]
        found |= children
        parents = set(children)
    return found


def test_sighup_to_the_process_group_ends_no_child(kept_server: ServerProcess) -> None:
    # OPERATIONS: SIGHUP may go to the whole group; the engine, multiprocessing's resource tracker
    # and every other child must survive it (the tracker used to die, left <defunct>)
    server = kept_server  # the leader of its own process group
    assert server.proc is not None
    before = _descendants(server.proc.pid)
    assert len(before) >= 2 and "Z" not in before.values(), before  # the engine and the tracker at least
    os.killpg(server.proc.pid, signal.SIGHUP)
    wait_for(lambda: "SIGHUP" in server.log() or "keys reloaded" in server.log(), "the server's SIGHUP line")
    assert _descendants(server.proc.pid) == before
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
