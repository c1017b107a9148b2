"""/tokenize and /detokenize (vLLM's shapes), authenticated; model generation defaults."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import KEYS, ServerProcess, client_for

from kvseal.errors import ConfigError
from kvseal.generation_defaults import GenerationDefaults
from kvseal.llm import LLM
from kvseal.server.protocol import ChatMessage
from kvseal.types import SamplingParams

ALICE = {"Authorization": "Bearer key-alice"}


def _post(server: ServerProcess, path: str, body: object, headers: dict[str, str] | None = ALICE) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def test_tokenize_prompt_and_chat_match_what_generation_admits(server: ServerProcess) -> None:
    prompt = _post(server, "/tokenize", {"prompt": "w10 w11 w12", "return_token_strs": True}).json()
    assert prompt == {"count": 3, "max_model_len": 512, "tokens": [10, 11, 12], "token_strs": ["w10", "w11", "w12"]}
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "w10"}]}).json()
    assert chat["tokens"] == [3, 10, 4, 5] and chat["token_strs"] is None  # the tiny chat template
    usage = client_for(server, "key-alice").chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": "w10"}], max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == chat["count"]


def test_openais_developer_role_is_the_templates_system_role(server: ServerProcess) -> None:
    """Taken (it was a 400), and rendered as the role the model's template knows."""
    assert ChatMessage(role="developer", content="w20").as_template_input()["role"] == "system"
    messages = [{"role": "developer", "content": "w20"}, {"role": "user", "content": "w10"}]
    assert _post(server, "/tokenize", {"messages": messages}).status_code == 200
    alice = client_for(server, "key-alice")
    alice.chat.completions.create(model=server.model_name, messages=messages, max_tokens=1)  # type: ignore[arg-type]


def test_vllms_add_special_tokens_is_taken_on_every_route(server: ServerProcess) -> None:
    """(What it changes is shown where the tokenizer has a BOS: tests/server/test_prompts.py.)"""
    assert _post(server, "/tokenize", {"prompt": "w10", "add_special_tokens": False}).json()["tokens"] == [10]
    messages = [{"role": "user", "content": "w10"}]
    assert _post(server, "/tokenize", {"messages": messages, "add_special_tokens": True}).status_code == 200
    for path, body in (("/v1/completions", {"prompt": "w10"}), ("/v1/chat/completions", {"messages": messages})):
        flipped = {"add_special_tokens": path.endswith("chat/completions")}  # each route's non-default
        response = _post(server, path, body | {"max_tokens": 1} | flipped)
        assert response.status_code == 200, response.text


def test_detokenize_round_trips(server: ServerProcess) -> None:
    assert _post(server, "/detokenize", {"tokens": [10, 11, 12]}).json() == {"prompt": "w10 w11 w12"}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "w5", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/detokenize", {"tokens": [600]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [5], "model": "other"}, 404, "model"),
])
def test_bad_bodies_are_openai_errors(server: ServerProcess, path: str, body: object, status: int,
                                      param: str) -> None:
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_routes_require_an_api_key(server: ServerProcess, path: str) -> None:
    for headers in (None, {"Authorization": "Bearer wrong"}):
        response = _post(server, path, {"tokens": [5]} if path == "/detokenize" else {"prompt": "w5"}, headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_generation_defaults_resolve(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.05, "do_sample": True}))
    auto = GenerationDefaults.load("auto", tmp_path)
    assert (auto.temperature, auto.top_p, auto.top_k, auto.min_p, auto.repetition_penalty) == (0.6, 0.9, -1, 0.05, 1.0)
    assert GenerationDefaults.load("vllm", tmp_path).temperature == 1.0
    assert GenerationDefaults.load("auto", tmp_path / "missing").temperature == 1.0
    path.write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ConfigError, match="temperature"):
        GenerationDefaults.load("auto", tmp_path)
    path.write_text(json.dumps({"top_p": "high"}))
    with pytest.raises(ConfigError, match="top_p"):
        GenerationDefaults.load("auto", tmp_path)
    path.write_text(json.dumps({"min_p": 2}))
    with pytest.raises(ConfigError, match="min_p"):
        GenerationDefaults.load("auto", tmp_path)


@pytest.fixture(scope="module")
def greedy_model_dir(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, shipping a generation_config.json that makes sampling greedy."""
    folder = tmp_path_factory.mktemp("greedy") / "tiny-greedy"
    shutil.copytree(server_model_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0, "top_k": 20}))
    return folder


@pytest.fixture(scope="module")
def greedy_server(greedy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(greedy_model_dir, tmp_path_factory.mktemp("greedy-server"), keys=KEYS)
    proc.start()
    yield proc
    proc.terminate()


def test_omitted_fields_take_the_model_defaults(greedy_server: ServerProcess, greedy_model_dir: Path) -> None:
    assert "temperature=0 top_p=1 top_k=20 min_p=0 repetition_penalty=1" in greedy_server.log()
    client = client_for(greedy_server, "key-alice")
    texts = {client.completions.create(model=greedy_server.model_name, prompt="w10 w11", max_tokens=8).choices[0].text
             for _ in range(2)}
    offline = LLM(str(greedy_model_dir), dtype="float32", kv_cache_tokens=256, page_size=4, max_model_len=256)
    assert texts == {offline.generate("w10 w11", SamplingParams(max_tokens=8, temperature=0))[0].text}
    hot = client.completions.create(model=greedy_server.model_name, prompt="w10 w11", max_tokens=8,
                                    temperature=1.5, seed=1).choices[0].text
    assert hot not in texts, "a request's own temperature wins over the default"
