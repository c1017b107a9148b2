"""/tokenize and /detokenize (vLLM's shapes), authenticated; model generation defaults."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import KEYS, ServerProcess, client_for

from kvseal.admission import AdmissionLimits
from kvseal.errors import ConfigError
from kvseal.generation_defaults import GenerationDefaults
from kvseal.llm import LLM
from kvseal.server.auth import Tenant
from kvseal.server.protocol import ChatMessage, CompletionRequest
from kvseal.server.sampling import build_sampling_params
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


def test_generation_defaults_take_max_new_tokens_as_a_default(tmp_path: Path) -> None:
    """transformers' max_new_tokens is vLLM's default max_tokens (`get_diff_sampling_param`):
    read under auto, ignored under vllm, and a bad value stops start-up naming the file."""
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"max_new_tokens": 7}))
    auto = GenerationDefaults.load("auto", tmp_path)
    assert auto.max_tokens == 7 and auto.sampling_params().max_tokens == 7
    assert f"max_tokens=7 [file] (file {path})" in auto.describe()
    neutral = GenerationDefaults.load("vllm", tmp_path)
    assert neutral.max_tokens is None and neutral.sampling_params().max_tokens == SamplingParams().max_tokens
    assert "max_tokens=(rest of the context) [neutral] (no file: --generation-config vllm)" in neutral.describe()
    path.write_text(json.dumps({"max_new_tokens": None, "temperature": 0.5}))
    assert GenerationDefaults.load("auto", tmp_path).max_tokens is None
    for bad in (-1, 0, 2.5, 100.0, True, "64"):
        path.write_text(json.dumps({"max_new_tokens": bad}))
        with pytest.raises(ConfigError, match=rf"{path}.*max_new_tokens must be a positive integer"):
            GenerationDefaults.load("auto", tmp_path)


def test_max_new_tokens_fills_only_an_omitted_max_tokens_under_the_context_and_tenant() -> None:
    """vLLM's `get_max_tokens`: the request's own value, else the default, and either at most
    the rest of the context; kvseal's tenant cap stays on top."""
    defaults = GenerationDefaults(max_tokens=10)
    limits = AdmissionLimits(max_model_len=64, kv_cache_tokens=256, vocab_size=100)

    def resolved(asked: int | None, num_prompt_tokens: int = 4, tenant: Tenant | None = None) -> int | None:
        tenant = tenant or Tenant("t")
        body = CompletionRequest(prompt="x", max_tokens=asked)
        return build_sampling_params(body, max_tokens=asked, num_prompt_tokens=num_prompt_tokens, limits=limits,
                                     logprobs=None, tenant=tenant, defaults=defaults).max_tokens

    assert resolved(None) == 10
    assert resolved(30) == 30, "a request's own max_tokens wins, even above max_new_tokens"
    assert resolved(3) == 3
    assert resolved(None, num_prompt_tokens=58) == 6, "the rest of the context caps the default"
    assert resolved(None, tenant=Tenant("t", max_tokens=4)) == 4
    assert build_sampling_params(CompletionRequest(prompt="x"), max_tokens=None, num_prompt_tokens=4, limits=limits,
                                 logprobs=None, tenant=Tenant("t")).max_tokens == 60, "no default: the rest"


@pytest.fixture(scope="module")
def greedy_model_dir(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, shipping a generation_config.json that makes sampling hot (the server's
    override makes it greedy) and caps an omitted max_tokens at 3."""
    folder = tmp_path_factory.mktemp("greedy") / "tiny-greedy"
    shutil.copytree(server_model_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"temperature": 1.5, "top_k": 20,
                                                                           "max_new_tokens": 3}))
    return folder


@pytest.fixture(scope="module")
def greedy_server(greedy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(greedy_model_dir, tmp_path_factory.mktemp("greedy-server"), keys=KEYS,
                         extra_args=["--override-generation-config", '{"temperature": 0}'])
    proc.start()
    yield proc
    proc.terminate()


def test_omitted_fields_take_the_override_then_the_model_defaults(greedy_server: ServerProcess,
                                                                   greedy_model_dir: Path) -> None:
    """The file's temperature (1.5) is overridden (0: greedy); its top_k and max_new_tokens stay,
    and the start-up line says where each value came from."""
    file = greedy_model_dir / "generation_config.json"
    assert ("temperature=0 [override] top_p=1 [neutral] top_k=20 [file] min_p=0 [neutral] repetition_penalty=1 "
            f"[neutral] max_tokens=3 [file] (file {file})") in greedy_server.log()
    client = client_for(greedy_server, "key-alice")
    texts = {client.completions.create(model=greedy_server.model_name, prompt="w10 w11", max_tokens=8).choices[0].text
             for _ in range(2)}
    offline = LLM(str(greedy_model_dir), dtype="float32", kv_cache_tokens=256, page_size=4, max_model_len=256)
    assert texts == {offline.generate("w10 w11", SamplingParams(max_tokens=8, temperature=0))[0].text}
    hot = client.completions.create(model=greedy_server.model_name, prompt="w10 w11", max_tokens=8,
                                    temperature=1.5, seed=1).choices[0].text
    assert hot not in texts, "a request's own temperature wins over the default"


def test_max_new_tokens_caps_only_an_omitted_max_tokens(greedy_server: ServerProcess) -> None:
    """The model's max_new_tokens (3) when chat omits max_tokens, and when completions send it
    as null; completions' omitted max_tokens is 16, their API's default, as in vLLM. The
    request's own value, larger, is kept (as vLLM: a default, not a limit)."""
    client = client_for(greedy_server, "key-alice")
    model, long = greedy_server.model_name, {"ignore_eos": True}
    omitted = client.completions.create(model=model, prompt="w10 w11", extra_body=long)
    assert (omitted.usage.completion_tokens, omitted.choices[0].finish_reason) == (16, "length")
    null = httpx.post(f"{greedy_server.base_url}/completions", headers={"Authorization": "Bearer key-alice"},
                      json={"model": model, "prompt": "w10 w11", "max_tokens": None, **long}, timeout=60).json()
    assert (null["usage"]["completion_tokens"], null["choices"][0]["finish_reason"]) == (3, "length"), null
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w10"}], extra_body=long)
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (3, "length")
    own = client.completions.create(model=model, prompt="w10 w11", max_tokens=6, extra_body=long)
    assert own.usage.completion_tokens == 6
    own_chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w10"}],
                                              max_completion_tokens=5, extra_body=long)
    assert own_chat.usage.completion_tokens == 5
