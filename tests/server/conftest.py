"""Fixtures: a tiny model written once, and one shared server with several tenants."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from char_model import make_char_model  # noqa: E402
from server_process import KEYS, MAX_BODY_BYTES, ServerProcess, client_for  # noqa: E402
from tiny_server_model import make_server_model  # noqa: E402


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_server_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(server_model_dir, tmp_path_factory.mktemp("server"), keys=KEYS,
                         extra_args=["--max-body-bytes", str(MAX_BODY_BYTES)])
    proc.start()
    yield proc
    proc.terminate()


@pytest.fixture
def alice(server: ServerProcess) -> openai.OpenAI:
    return client_for(server, "key-alice")


@pytest.fixture
def bob(server: ServerProcess) -> openai.OpenAI:
    return client_for(server, "key-bob")


@pytest.fixture(scope="session")
def char_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A character-level tiny model: JSON and tool calls can be spelled with its tokens."""
    return make_char_model(tmp_path_factory.mktemp("char") / "char-llama")


@pytest.fixture(scope="session")
def char_server(char_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(char_dir, tmp_path_factory.mktemp("char-server"), keys=KEYS,
                         extra_args=["--tool-call-parser", "hermes", "--max-model-len", "1024"])
    proc.start()
    yield proc
    proc.terminate()


@pytest.fixture(scope="module")
def reasoning_server(char_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The character-level model served as a thinking model: its grammars wait for `</think>`."""
    proc = ServerProcess(char_dir, tmp_path_factory.mktemp("reasoning-server"), keys=KEYS,
                         extra_args=["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                                     "--max-model-len", "1024"])
    proc.start()
    yield proc
    proc.terminate()
