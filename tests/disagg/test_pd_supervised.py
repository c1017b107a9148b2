"""`kvseal serve --pd` supervises the engines it started: an engine killed by its PID is reaped
(no <defunct> child), its exit logged, its requests fail with errors (never a 200 with another
marker's text), it is restarted at the same address, and the frontend serves again with the
new instance; the dead instance's per-engine series leave /metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from pathlib import Path

import httpx
import pytest
from marker_model import marker_prompt
from pd_servers import ENGINE_FLAGS, KEYS, Proc
from processes import free_port, wait_for

from kvseal.cli import build_parser
from kvseal.disagg.frontend import DEAD_AFTER_S, PdClient
from kvseal.disagg.msgs import EngineInfoMsg, Role
from kvseal.disagg.serve import SpawnedEngines
from kvseal.disagg.topology import PdTopology
from kvseal.engine.supervisor import RestartPolicy
from kvseal.engine_args import engine_args_from

FLAGS = [*ENGINE_FLAGS, "--kv-cache-tokens", "1024", "--max-model-len", "512"]
MAX_TOKENS = 6
_markers = count(300)


class PdServe(Proc):
    def __init__(self, model: Path, workdir: Path) -> None:
        self.port = free_port()
        keys = workdir / "keys.json"
        workdir.mkdir(parents=True, exist_ok=True)
        keys.write_text(json.dumps(KEYS))
        super().__init__("serve-pd", ["serve", "--pd", "--model", str(model), "--port", str(self.port),
                                      "--api-keys", str(keys), "--audit-log", str(workdir / "audit.jsonl"),
                                      "--engine-restart-backoff-s", "0.5", *FLAGS], workdir)
        self.url = f"http://127.0.0.1:{self.port}"

    def engine_pid(self, role: str) -> int:
        """The newest pid of the `role` engine, from the log (started, or restarted)."""
        pids = re.findall(rf"(?:{role} engine \(pid |restarted the {role} engine at \S+ \(pid )(\d+)\)", self.log())
        return int(pids[-1])

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", headers={"Authorization": "Bearer key-ops"}, timeout=10).text

    def instance(self, role: str) -> str | None:
        match = re.search(rf'kvseal_pd_kv_pages_used{{engine="({role}-[^"]+)",role="{role}"}}', self.metrics())
        return match.group(1) if match else None


@pytest.fixture
def pd_serve(marker_dir: Path, tmp_path: Path) -> Iterator[PdServe]:
    server = PdServe(marker_dir, tmp_path)
    server.start()
    try:
        server.wait_until_healthy(server.url)
        yield server
    finally:
        server.kill()


def send(server: PdServe, length: int = 40) -> tuple[int, int, str]:
    """(marker, status, text) of one request of alice; for an error, its message."""
    marker = next(_markers)
    response = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer key-alice"}, timeout=60,
                          json={"prompt": marker_prompt(marker, length), "max_tokens": MAX_TOKENS, "temperature": 0})
    if response.status_code != 200:
        assert response.status_code >= 500 and response.json()["error"]["code"], response.text
        return marker, response.status_code, response.json()["error"]["message"]
    return marker, 200, response.json()["choices"][0]["text"]


def assert_own_or_error(results: list[tuple[int, int, str]]) -> None:
    for marker, status, text in results:
        assert status >= 500 or text.split() == [f"w{marker}"] * MAX_TOKENS, (marker, status, text)


def is_reaped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def serves_again(server: PdServe) -> bool:
    result = send(server)
    assert_own_or_error([result])
    return result[1] == 200


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_engine_is_restarted_and_its_series_dropped(pd_serve: PdServe, role: str) -> None:
    ready = wait_for(lambda: re.search(r"kvseal ready: .* \(prefill engine pid (\d+), decode engine pid (\d+)\)$",
                                       pd_serve.log(), re.MULTILINE), "the ready line, naming both engines' pids")
    assert [int(pid) for pid in ready.groups()] == [pd_serve.engine_pid("prefill"), pd_serve.engine_pid("decode")]
    assert serves_again(pd_serve)
    old_pid, old_instance = pd_serve.engine_pid(role), wait_for(lambda: pd_serve.instance(role), "its series")
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(send, pd_serve, 200) for _ in range(4)]
        os.kill(old_pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    assert_own_or_error(results)
    wait_for(lambda: f"restarted the {role} engine" in pd_serve.log(), "the restart")
    meanwhile = [send(pd_serve) for _ in range(3)]
    assert_own_or_error(meanwhile)
    for _, status, text in meanwhile:  # while it loads: 503 saying what happened (no PID, no address)
        assert status == 200 or (f"no {role} engine is reachable (the {role} engine exited (killed by SIGKILL "
                                 f"(signal 9)); restarted at " in text and str(old_pid) not in text), text
    wait_for(lambda: serves_again(pd_serve), "serving again", deadline_s=120)
    assert is_reaped(old_pid)
    assert re.search(rf"the {role} engine \(pid {old_pid}\) at \S+ exited \(killed by SIGKILL \(signal 9\)\); "
                     rf"restarting it in 0.5 s", pd_serve.log())
    new_instance = wait_for(lambda: pd_serve.instance(role), "the new instance's series")
    metrics = pd_serve.metrics()
    assert new_instance != old_instance and f'engine="{old_instance}"' not in metrics
    assert f'kvseal_engine_restarts_total{{role="{role}"}} 1.0' in metrics
    assert pd_serve.engine_pid(role) != old_pid
    assert pd_serve.terminate() == 0


class FakeProcess:
    """An engine process as the supervisor sees it (pid, exit code), without an engine."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        self.exitcode = -signal.SIGTERM

    kill = terminate


def _fake_supervisor(marker_dir: Path, monkeypatch: pytest.MonkeyPatch,
                     first_pid: int) -> tuple[PdTopology, SpawnedEngines]:
    """`serve --pd`'s supervisor over processes as it sees them (`FakeProcess`: no engine starts)."""
    pids = count(first_pid)
    monkeypatch.setattr(SpawnedEngines, "_spawn", lambda self, config: FakeProcess(next(pids)))
    ns = build_parser().parse_args(["serve", "--pd", "--model", str(marker_dir), *FLAGS])
    topology = PdTopology.from_namespace(ns)
    assert topology is not None
    return topology, SpawnedEngines(topology, engine_args_from(ns), argparse.Namespace(**vars(ns)),
                                    RestartPolicy(engine_restart_limit=5, engine_restart_backoff_s=0))


def test_the_503_reason_describes_the_engine_as_it_is_now(marker_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed, restarted, killed again before the supervisor reaped it: the reason clients get
    says the restarted engine exited, not that the first one did and its successor is starting;
    and it names no PID or address (the log does)."""
    topology, spawned = _fake_supervisor(marker_dir, monkeypatch, first_pid=40001)
    first = spawned.processes[0]
    assert spawned.why_down("prefill") is None
    first.exitcode = -signal.SIGKILL
    assert spawned.why_down("prefill") == "the prefill engine exited (killed by SIGKILL (signal 9))"
    spawned._check(0)  # reaped, its restart due at once
    spawned._check(0)  # restarted
    second = spawned.processes[0]
    assert second is not first and "restarted at" in (spawned.why_down("prefill") or "")
    second.exitcode = 1
    assert spawned.why_down("prefill") == "the prefill engine exited (exit code 1)"
    spawned._check(0)
    assert spawned.why_down("prefill") == "the prefill engine exited (exit code 1); restarting it in 0 s"
    address = topology.prefill[0].address
    for why in (spawned.why_down("prefill") or "", spawned.why_down("decode") or ""):
        assert str(first.pid) not in why and str(second.pid) not in why and address not in why
    spawned.stop()


def _engine_info(role: Role, address: str, instance: str) -> EngineInfoMsg:
    return EngineInfoMsg(role, address, instance, 1, "m", "/m", "llama", 64, 256, 512, 4, 64, "layout", "tcp", "off")


@pytest.fixture
def supervised_client(marker_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PdClient, SpawnedEngines]]:
    """A PD frontend over `--pd`'s supervisor, its engines processes as the supervisor sees them
    (no engine starts): decode killed, reaped and restarted once."""
    topology, spawned = _fake_supervisor(marker_dir, monkeypatch, first_pid=41001)
    client = PdClient(list(topology.prefill), list(topology.decode), "/tokenizer", topology.link_key, spawned)
    try:
        prefill, decode = client.links
        for link in (prefill, decode):
            client._on_info(link, _engine_info(link.role, link.address, f"{link.role}-1"))
        spawned.processes[1].exitcode = -signal.SIGKILL
        client._engine_down(decode, "the decode engine disconnected")
        spawned._check(1)  # reaped, its restart due at once
        spawned._check(1)  # restarted
        assert "restarted at" in (client.failure or "")  # the new decode engine has not answered yet
        yield client, spawned
    finally:
        asyncio.run(client.shutdown(timeout_s=0))


def test_a_restarted_engine_that_answered_is_described_by_its_own_state(
        supervised_client: tuple[PdClient, SpawnedEngines]) -> None:
    """Decode restarted, answered, served, then went down while its process lives (here its link
    dropped): clients and /health are told that, not that an earlier instance was killed and this
    one is "restarted at ..., waiting for it to answer" (the story of a restart long over)."""
    client, spawned = supervised_client
    decode = client.links[1]
    client._on_info(decode, _engine_info("decode", decode.address, "decode-2"))
    assert client.failure is None
    client._engine_down(decode, "the decode engine disconnected")
    assert client.failure == "no decode engine is reachable (the decode engine disconnected)"
    spawned.processes[1].exitcode = 1  # and its process exited: said at once, before it is reaped
    assert client.failure == "no decode engine is reachable (the decode engine exited (exit code 1))"


def test_a_hung_engine_is_described_as_silent_since_then(supervised_client: tuple[PdClient, SpawnedEngines]) -> None:
    """Decode restarted, answered, then fell silent (SIGSTOP): after `DEAD_AFTER_S` it is down, and
    the reason says since when it has not answered, for as long as that lasts."""
    client, _ = supervised_client
    prefill, decode = client.links
    client._on_info(decode, _engine_info("decode", decode.address, "decode-2"))
    prefill.last_seen_s = decode.last_seen_s + DEAD_AFTER_S  # prefill answered since
    client._mark_silent_down(decode.last_seen_s + DEAD_AFTER_S + 1)
    assert prefill.is_up and not decode.is_up
    assert re.fullmatch(r"no decode engine is reachable \(the decode engine has not answered since "
                        r"\d\d:\d\d:\d\d UTC\)", client.failure or ""), client.failure
