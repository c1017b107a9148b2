"""vLLM's chat rendering fields: `add_generation_prompt`, `continue_final_message` and
`chat_template_kwargs` (e.g. Qwen3's `enable_thinking`), on /v1/chat/completions, /tokenize and
offline `LLM.chat`, each the same token ids; what the template cannot honour is a 400 naming
the field. The tiny template: `w3 {content} w4` per message, `w5` as the generation prompt,
` w6` when `enable_thinking` is true."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import KEYS, ServerProcess

from kvseal.errors import ConfigError, InvalidParameter
from kvseal.llm import LLM
from kvseal.prompting import load_chat_template
from kvseal.types import SamplingParams

MESSAGES = [{"role": "user", "content": "w10 w11"}]
OPEN = [*MESSAGES, {"role": "assistant", "content": "w20 w21"}]


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": "Bearer key-alice"}, timeout=60)


def tokens(server: ServerProcess, **fields: Any) -> list[int]:
    response = post(server, "/tokenize", {"messages": MESSAGES} | fields)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]  # type: ignore[no-any-return]


def test_each_field_shapes_the_prompt(server: ServerProcess) -> None:
    plain = tokens(server)
    assert plain == [3, 10, 11, 4, 5]
    assert tokens(server, add_generation_prompt=False) == [3, 10, 11, 4]
    assert tokens(server, chat_template_kwargs={"enable_thinking": True}) == [3, 10, 11, 4, 5, 6]
    assert tokens(server, chat_template_kwargs={"enable_thinking": False}) == plain
    assert tokens(server, messages=OPEN, add_generation_prompt=False, continue_final_message=True) == \
        [3, 10, 11, 4, 3, 20, 21], "the assistant's message left open: no w4 after it"


def test_chat_completions_render_as_tokenize_and_as_offline(server: ServerProcess, server_model_dir: Path) -> None:
    fields = {"messages": OPEN, "add_generation_prompt": False, "continue_final_message": True,
              "chat_template_kwargs": {"enable_thinking": True}}
    response = post(server, "/v1/chat/completions", fields | {"max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    ids = tokens(server, **fields)
    assert body["usage"]["prompt_tokens"] == len(ids)
    llm = LLM(str(server_model_dir), dtype="float32", kv_cache_tokens=512, page_size=4, max_model_len=256)
    [out] = llm.chat(OPEN, SamplingParams(max_tokens=4, temperature=0), add_generation_prompt=False,
                     continue_final_message=True, chat_template_kwargs={"enable_thinking": True})
    assert out.prompt_token_ids == ids and out.text == body["choices"][0]["message"]["content"]
    record = server.audit_for(response.headers["x-request-id"])
    assert {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"} <= set(record["features"])


def test_echo_starts_the_answer_with_the_continued_message(server: ServerProcess) -> None:
    """vLLM's chat `echo`: the answer's content starts with the last message's when that message
    is the answer's turn (an assistant's; any last one without a generation prompt), streamed
    after the role; a user's last message before a generation prompt is not echoed."""
    fields = {"messages": OPEN, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3,
              "temperature": 0, "n": 2}
    plain = post(server, "/v1/chat/completions", fields).json()["choices"]
    echoed = post(server, "/v1/chat/completions", fields | {"echo": True}).json()["choices"]
    assert [c["message"]["content"] for c in echoed] == ["w20 w21" + c["message"]["content"] for c in plain]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=fields | {"echo": True, "stream": True},
                      headers={"Authorization": "Bearer key-alice"}, timeout=60) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [(c["index"], c["delta"]) for line in lines for c in json.loads(line)["choices"]]
    assert deltas[:4] == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
                          (0, {"content": "w20 w21"}), (1, {"content": "w20 w21"})], deltas[:4]
    for index in (0, 1):
        assert "".join(d.get("content", "") for i, d in deltas if i == index) == echoed[index]["message"]["content"]
    asked = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0,
                                                  "echo": True}).json()
    unasked = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}).json()
    assert asked["choices"][0]["message"]["content"] == unasked["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("fields", "param", "problem"), [
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt=false"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set ['messages']"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "may not set"),
    ({"chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs", "pattern"),
    ({"chat_template_kwargs": {"x": "y" * 5000}}, "chat_template_kwargs", "limit is 4096"),
    ({"chat_template_kwargs": {f"k{i}": 1 for i in range(33)}}, "chat_template_kwargs", "at most 32 items"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_what_the_template_cannot_honour_is_400_naming_it(server: ServerProcess, path: str, fields: dict[str, Any],
                                                          param: str, problem: str) -> None:
    response = post(server, path, {"messages": MESSAGES, "max_tokens": 2} | fields if path != "/tokenize"
                    else {"messages": MESSAGES} | fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") + error["message"] and problem in error["message"], error


def test_offline_refuses_the_same(server_model_dir: Path) -> None:
    llm = LLM(str(server_model_dir), dtype="float32", kv_cache_tokens=512, page_size=4, max_model_len=256)
    with pytest.raises(InvalidParameter) as info:
        llm.chat(OPEN, continue_final_message=True)
    assert info.value.param == "continue_final_message"
    with pytest.raises(InvalidParameter) as info:
        llm.chat(MESSAGES, chat_template_kwargs={"tools": []})
    assert info.value.param == "chat_template_kwargs"


# ---- vLLM's --chat-template: the operator's template instead of the model's ---------------------

OWN_TEMPLATE = "{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


def test_chat_template_flag_replaces_the_models_template(server_model_dir: Path, tmp_path: Path) -> None:
    """From a file: /tokenize, chat completions and offline `LLM.chat(chat_template=...)` render
    it alike, and the model's own template (w3 ... w4) is not used."""
    template_file = tmp_path / "template.jinja"
    template_file.write_text(OWN_TEMPLATE)
    proc = ServerProcess(server_model_dir, tmp_path / "server", keys=KEYS,
                         extra_args=["--chat-template", str(template_file)])
    proc.start()
    try:
        assert tokens(proc) == [7, 10, 11, 8, 9]
        assert tokens(proc, add_generation_prompt=False) == [7, 10, 11, 8]
        response = post(proc, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == 5
        assert "chat template: --chat-template" in proc.log()
    finally:
        proc.terminate()
    llm = LLM(str(server_model_dir), dtype="float32", kv_cache_tokens=512, page_size=4, max_model_len=256)
    [out] = llm.chat(MESSAGES, SamplingParams(max_tokens=3, temperature=0), chat_template=OWN_TEMPLATE)
    assert out.prompt_token_ids == [7, 10, 11, 8, 9]
    assert out.text == response.json()["choices"][0]["message"]["content"]


def test_chat_template_flag_takes_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(OWN_TEMPLATE)
    assert load_chat_template(str(path)) == OWN_TEMPLATE
    assert load_chat_template(OWN_TEMPLATE) == OWN_TEMPLATE
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    with pytest.raises(ConfigError, match="names no readable file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
