"""I9 against real processes, as an attacker on the same host sees them: the engines' ports come
from the process list or the frontend's log, their public keys from their (world-readable)
public key files or the log. A rogue with no key, a key of its own, or prefill's key (which
decode accepts from a peer only) gets nothing from a prefill or decode engine: no hello answer,
no reservation, no cached-token count, no shutdown; the engines go on serving and count the
refusals (`kvseal_pd_link_refusals`). On `kvseal serve --pd` the negative control runs the same
deployment with authentication off (test-only fault in every process): the rogue's reservation
then reads 112 cached tokens of alice's 113-token prompt.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import httpx
import pytest
from pd_servers import ENGINE_FLAGS, KEYS, PdCluster, PdEngine, PdFrontend, Proc, assert_engines_clean
from processes import free_port, wait_for
from rogue import Rogue
from test_engine_auth import SECRET_PROMPT, frontend_msgs, probe

from kvseal.cli import build_parser
from kvseal.disagg.link_keys import KeyPair, generate_keys, load_public_keys
from kvseal.disagg.msgs import ReservedMsg
from kvseal.disagg.serve import SpawnedEngines
from kvseal.disagg.topology import PdTopology
from kvseal.engine_args import engine_args_from
from kvseal.messages.msgs import AbortMsg

ROGUES = ["no key", "its own key", "prefill's peer key"]
PD_FLAGS = [*ENGINE_FLAGS, "--kv-cache-tokens", "1024", "--max-model-len", "512"]


def listen_address_of(pid: int) -> str:
    """What `ps` shows any local user: the engine's command line, with its --listen address."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--listen") + 1].decode()


def complete(url: str, prompt: list[int], key: str = "key-alice") -> dict:  # type: ignore[type-arg]
    response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                          headers={"authorization": f"Bearer {key}"}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def cached_tokens(body: dict) -> int:  # type: ignore[type-arg]
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def refusals(cluster: PdCluster, role: str, kind: str) -> float:
    return cluster.frontend.metric("kvseal_pd_link_refusals", role=role, kind=kind)


def test_separate_engines_give_a_rogue_nothing(pd_cluster: PdCluster) -> None:
    cluster = pd_cluster
    alice = complete(cluster.frontend.url, SECRET_PROMPT)
    assert alice["usage"]["prompt_tokens"] == 113
    for engine in (cluster.prefill, cluster.decode):
        for kind in ROGUES:
            assert_rogue_gets_nothing(cluster, engine, kind)
    for engine in (cluster.prefill, cluster.decode):
        engine.assert_running()  # no rogue shut it down
    again = complete(cluster.frontend.url, SECRET_PROMPT)  # both engines still serve alice, from her cache
    assert cached_tokens(again) == 112 and again["choices"] == alice["choices"]
    assert_engines_clean(cluster.prefill, cluster.decode)


def assert_rogue_gets_nothing(cluster: PdCluster, engine: PdEngine, kind: str) -> None:
    """The rogue sends every frontend message (hello, integrity, alice's reservation, an abort,
    shutdown) and gets nothing back; the engine counts the refusal where it sees one."""
    assert engine.proc is not None
    keys = engine.keys
    public = load_public_keys(str(keys.public(engine.role)), "test")[0].key  # the engine's public key file
    own = {"no key": None, "its own key": KeyPair.ephemeral("mallory"), "prefill's peer key": keys.pair("prefill")}
    before = {k: refusals(cluster, engine.role, k) for k in ("handshake", "message")}
    rogue = Rogue(listen_address_of(engine.proc.pid), own[kind], public)
    try:
        msgs = frontend_msgs()
        rogue.send(*msgs)
        handshake = rogue.handshake()
        if kind == "prefill's peer key" and engine.role == "decode":
            assert handshake == "succeeded"  # a peer: its frontend messages are refused one by one
            wait_for(lambda: refusals(cluster, "decode", "message") == before["message"] + len(msgs),
                     "decode to count the refused messages")
        elif kind == "no key":
            assert handshake in ("failed_protocol", "failed")
        else:
            assert handshake == "refused_key"
            wait_for(lambda: refusals(cluster, engine.role, "handshake") == before["handshake"] + 1,
                     f"{engine.role} to count the refused handshake")
        assert rogue.collect(wait_ms=1000) == [], f"{engine.role} answered a rogue with {kind}"
    finally:
        rogue.close()


def serve_pd(tmp_path: Path, model: Path, faults: str) -> tuple[Proc, str]:
    port = free_port()
    keys_path = tmp_path / "api-keys.json"
    keys_path.write_text(json.dumps(KEYS))
    argv = ["serve", "--pd", "--model", str(model), "--port", str(port), "--api-keys", str(keys_path), *PD_FLAGS]
    return Proc(f"serve-pd-{faults}", argv, tmp_path, faults).start(), f"http://127.0.0.1:{port}"


def decode_of(log: str) -> tuple[str, bytes]:
    """The decode engine's address and public key, from the frontend's start-up log."""
    address = re.search(r"decode engine \(pid \d+\) at (\S+)", log)
    assert address is not None, log
    key = re.search(rf"PD engine at {re.escape(address.group(1))} must prove the public key (\S+)", log)
    assert key is not None, log
    return address.group(1), key.group(1).encode()


@pytest.mark.parametrize("faults", ["none", "open_engine_links"])
def test_serve_pd_gives_a_rogue_nothing_unless_authentication_is_off(tmp_path: Path, marker_dir: Path,
                                                                     faults: str) -> None:
    server, url = serve_pd(tmp_path, marker_dir, faults)
    try:
        server.wait_until_healthy(url)
        alice = complete(url, SECRET_PROMPT)
        assert alice["usage"]["prompt_tokens"] == 113
        address, public = decode_of(server.log())
        rogue = Rogue(address, KeyPair.ephemeral("mallory"), public)
        try:
            if faults == "none":
                rogue.send(*frontend_msgs())
                assert rogue.handshake() == "refused_key"
                assert rogue.collect(wait_ms=2000) == [], "decode answered a rogue"
            else:  # negative control: the same rogue, every engine link open
                rogue.send(probe())
                assert rogue.handshake() == "succeeded"
                wait_for(lambda: any(isinstance(m, ReservedMsg) for m in rogue.collect()), "decode's answer")
                reserved = next(m for m in rogue.received if isinstance(m, ReservedMsg))
                assert reserved.num_cached_tokens == 112, "the oracle: 112 of alice's 113 tokens are cached"
                rogue.send(AbortMsg(reserved.request_id, "alice", "the rogue is done"))
        finally:
            rogue.close()
        again = complete(url, SECRET_PROMPT)  # decode still serves (no rogue shut it down)
        assert cached_tokens(again) == 112
    finally:
        assert server.terminate() == 0


def test_serve_pd_hands_its_engines_their_keys_outside_argv_and_environment(marker_dir: Path) -> None:
    """`ps` and /proc show every local user a process's argv (and its owner its environment):
    the throw-away secrets of `serve --pd` appear in neither of its engines'."""
    ns = build_parser().parse_args(["serve", "--pd", "--model", str(marker_dir), *PD_FLAGS])
    topology = PdTopology.from_namespace(ns)
    assert topology is not None and topology.spawn_keys is not None
    secrets = [topology.link_key.secret, topology.spawn_keys.prefill.secret, topology.spawn_keys.decode.secret]
    spawned = SpawnedEngines(topology, engine_args_from(ns), argparse.Namespace(**vars(ns)))
    try:
        for process in spawned.processes:
            seen = [Path(f"/proc/{process.pid}/{name}").read_bytes() for name in ("cmdline", "environ")]
            for secret in secrets:
                assert not any(secret in part for part in seen), "a secret key in an engine's argv or environment"
    finally:
        spawned.stop()


def test_an_engine_started_by_hand_logs_no_secret(pd_cluster: PdCluster) -> None:
    """The engines' own logs name their keys' files and public keys at most, never a secret."""
    for engine in (pd_cluster.prefill, pd_cluster.decode):
        secret = engine.keys.pair(engine.role).secret
        assert isinstance(engine, PdEngine) and secret.decode() not in engine.log()


def test_a_frontend_whose_key_no_engine_lists_is_refused_and_says_so(pd_cluster: PdCluster, tmp_path: Path) -> None:
    """An impostor `kvseal serve` (the right engines' addresses and public keys, its own key
    pair) gets no engine: both refuse its handshake and count it, and its log names the fix."""
    impostor_keys = tmp_path / "impostor"
    generate_keys(impostor_keys, ["impostor"])
    before = {role: refusals(pd_cluster, role, "handshake") for role in ("prefill", "decode")}
    impostor = PdFrontend([pd_cluster.prefill], [pd_cluster.decode], pd_cluster.marker_dir, pd_cluster.workdir, KEYS,
                          extra=["--link-key", str(impostor_keys / "impostor.key_secret")]).start()
    try:
        wait_for(lambda: impostor.log().count("refused this frontend's key") >= 2, "the impostor's log")
        for role in ("prefill", "decode"):
            wait_for(lambda r=role: refusals(pd_cluster, r, "handshake") > before[r], f"{role} to count it")
        assert impostor.health() != 200
    finally:
        impostor.terminate()
    pd_cluster.frontend.wait_healthy()  # the real frontend was never disturbed
