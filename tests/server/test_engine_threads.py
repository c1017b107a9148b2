"""`--threads N`: the engine process (colocated serve, offline) runs torch with N intra-op
threads; a count it cannot honour, or one PD would ignore, is refused before anything starts."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from server_process import ServerProcess

from kvseal import LLM, SamplingParams
from kvseal.cli import main
from kvseal.disagg.link_keys import generate_keys


def _not_the_default() -> int:
    """A count torch never picks by itself here (its default is at most one per CPU)."""
    return (os.cpu_count() or 1) + 1


def test_colocated_serve_engine_runs_with_the_given_threads(server_model_dir: Path, tmp_path: Path) -> None:
    threads = _not_the_default()
    server = ServerProcess(server_model_dir, tmp_path, extra_args=["--threads", str(threads)]).start()
    try:
        # the engine process itself logs torch.get_num_threads() once its model is loaded
        logged = re.findall(r"\[engine\]: kvseal engine: .* torch_threads=(\d+)", server.log())
        assert logged == [str(threads)], server.log()
    finally:
        assert server.terminate() == 0


def test_offline_engine_sets_the_given_threads(server_model_dir: Path) -> None:
    before = torch.get_num_threads()
    threads = _not_the_default()
    try:
        llm = LLM(str(server_model_dir), dtype="float32", kv_cache_tokens=256, max_model_len=128, page_size=4,
                  num_threads=threads)
        assert torch.get_num_threads() == threads
        assert llm.generate([5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0].token_ids
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("argv", [
    ["generate", "--threads", "0", "hello"],
    ["serve", "--threads", "-1"],
    ["serve", "--pd", "--threads", "1"],  # the PD engines take --pd-threads; --threads would be ignored
    ["serve", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:10", "--threads", "1"],
])
def test_threads_that_cannot_be_honoured_are_refused(argv: list[str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    if "--prefill" in argv:  # PD against running engines needs its keys before anything else is checked
        generate_keys(tmp_path / "keys", ["frontend", "prefill", "decode"])
        argv = [*argv, "--link-key", "keys/frontend.key_secret", "--prefill-keys", "keys/prefill.key",
                "--decode-keys", "keys/decode.key"]
    before = torch.get_num_threads()
    assert main(argv) == 2
    assert "kvseal: error: --threads" in capsys.readouterr().err
    assert torch.get_num_threads() == before
