"""The ranks' key and its proof, in process: key files (written 0600, refused when others may read
them), `kvseal keys tp-key`, `kvseal tp-node`'s refusals, the stdin hand-over, and the tags."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from kvseal.cli import main
from kvseal.config import EngineArgs
from kvseal.engine import engine as engine_module
from kvseal.engine.engine import LLMEngine
from kvseal.errors import ConfigError
from kvseal.parallel.node import run_node
from kvseal.parallel.rank_auth import new_nonce, refused_ranks, tag_of
from kvseal.parallel.tp_key import KEY_BYTES, engine_secret, load_tp_key, read_secret, write_tp_key

NODE_1 = ["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "29999"]


def test_keys_tp_key_writes_a_0600_key_and_never_overwrites(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tp.key"
    old = os.umask(0)  # the most permissive umask: the file is 0600 all the same
    try:
        assert main(["keys", "tp-key", str(path)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(load_tp_key(path)) == KEY_BYTES
    assert main(["keys", "tp-key", str(path)]) == 2
    assert "never overwritten" in capsys.readouterr().err


def test_keys_tp_key_refuses_a_folder_that_does_not_exist(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "no-folder" / "tp.key"
    assert main(["keys", "tp-key", str(path)]) == 2
    assert f"cannot write keys to {path}: " in capsys.readouterr().err


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_key_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = write_tp_key(tmp_path / "tp.key")
    path.chmod(mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_tp_key(path)


def test_a_missing_or_malformed_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no key file"):
        load_tp_key(tmp_path / "missing")
    bad = tmp_path / "bad.key"
    bad.write_text("not hex\n")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match="64 hex digits"):
        load_tp_key(bad)


def test_tp_node_refuses_a_missing_or_group_readable_key_file(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Before it resolves the model or starts a rank (the model here does not exist)."""
    assert main(["tp-node", str(tmp_path / "no-model"), *NODE_1]) == 2
    assert "--tp-key-file" in capsys.readouterr().err
    key = write_tp_key(tmp_path / "tp.key")
    key.chmod(0o640)
    assert main(["tp-node", str(tmp_path / "no-model"), *NODE_1, "--tp-key-file", str(key)]) == 2
    assert "readable or writable by other users (mode 640)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no key file"):
        run_node(EngineArgs(model=str(tmp_path / "no-model"), tensor_parallel_size=2, nnodes=2, node_rank=1,
                            master_port=29999, tp_key_file=str(tmp_path / "absent.key")))


@pytest.mark.parametrize("nnodes", [1, 2])
def test_node_0_checks_its_key_file_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           nnodes: int) -> None:
    """The engine (node 0, or a one-node engine given a key file) refuses a missing, group-readable
    or malformed --tp-key-file before it loads any weights, as every `kvseal tp-node` does."""
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: pytest.fail("the model loaded before the key"))
    flags = dict(model=str(tmp_path / "no-model"), tensor_parallel_size=2, nnodes=nnodes, master_port=29999)
    open_key = write_tp_key(tmp_path / "open.key")
    open_key.chmod(0o640)
    malformed = tmp_path / "malformed.key"
    malformed.write_text("00" * (KEY_BYTES - 1) + "\n")
    malformed.chmod(0o600)
    for key_file, why in [(tmp_path / "absent.key", "no key file"), (open_key, "chmod 600"),
                          (malformed, "64 hex digits")]:
        with pytest.raises(ConfigError, match=why):
            LLMEngine(EngineArgs(**flags, tp_key_file=str(key_file)))  # type: ignore[arg-type]
    if nnodes > 1:
        with pytest.raises(ConfigError, match="needs --tp-key-file"):
            LLMEngine(EngineArgs(**flags))  # type: ignore[arg-type]


def test_one_node_draws_a_fresh_key_several_need_the_file(tmp_path: Path) -> None:
    assert engine_secret(None, 1) != engine_secret(None, 1)
    with pytest.raises(ConfigError, match="--tp-key-file"):
        engine_secret(None, 2)
    key = write_tp_key(tmp_path / "tp.key")
    assert engine_secret(str(key), 2) == load_tp_key(key)


def test_a_worker_takes_exactly_its_key_from_stdin() -> None:
    key = os.urandom(KEY_BYTES)
    assert read_secret(io.BytesIO(key)) == key
    for wrong in (b"", key[:-1], key + b"\n"):
        with pytest.raises(ConfigError, match="on stdin"):
            read_secret(io.BytesIO(wrong))


def test_tags_prove_the_key_for_one_rank_one_group_and_these_nonces() -> None:
    key, other = os.urandom(KEY_BYTES), os.urandom(KEY_BYTES)
    nonces = [new_nonce() for _ in range(3)]
    tags = [tag_of(key, "start", 3, rank, nonces) for rank in range(3)]
    assert refused_ranks(key, "start", 0, nonces, tags) == []
    assert refused_ranks(key, "start", 0, nonces, [tags[0], tag_of(other, "start", 3, 1, nonces), tags[2]]) == [1]
    assert refused_ranks(key, "start", 1, nonces, [tags[0], tags[1], tags[1]]) == [2], "a tag names its rank"
    assert refused_ranks(key, "serving", 0, nonces, tags) == [1, 2], "a tag names its group"
    fresh = [nonces[0], new_nonce(), nonces[2]]  # rank 1 drew a new nonce: the old tags are replays
    assert refused_ranks(key, "start", 1, fresh, tags) == [0, 2]
