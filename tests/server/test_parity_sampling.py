"""OpenAI parity over HTTP: penalties, logit_bias, stop_token_ids, `n` (with logprobs and
streaming), and the audit log's record of which features a request used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_process import ServerProcess

from kvseal.llm import LLM
from kvseal.types import SamplingParams

PROMPT = "w10 w11 w12 w13 w14"


@pytest.fixture(scope="module")
def offline(server_model_dir: Path) -> LLM:
    """The same model through the offline engine (itself checked against transformers)."""
    return LLM(str(server_model_dir), dtype="float32", kv_cache_tokens=2048, page_size=4, max_model_len=512)


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"repetition_penalty": 1.6},
    {"logit_bias": {"40": 6.0}},
])
def test_penalties_and_bias_equal_the_offline_engine(server: ServerProcess, alice: openai.OpenAI, offline: LLM,
                                                      fields: dict[str, Any]) -> None:
    out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                   extra_body={k: v for k, v in fields.items() if k == "repetition_penalty"},
                                   **{k: v for k, v in fields.items() if k != "repetition_penalty"})
    bias = {int(t): b for t, b in fields.get("logit_bias", {}).items()}
    params = SamplingParams(max_tokens=12, temperature=0, **{**fields, "logit_bias": bias})
    plain = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    expected = offline.generate(PROMPT, params)[0]
    assert out.choices[0].text == expected.text and expected.text != plain.text


def test_stop_token_ids(server: ServerProcess, alice: openai.OpenAI) -> None:
    full = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    words = full.choices[0].text.split()
    stop_word = words[2]
    out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                   extra_body={"stop_token_ids": [int(stop_word[1:])]})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text.split() == words[:words.index(stop_word)], "up to its first occurrence, left out"
    assert out.choices[0].model_extra == {"stop_reason": int(stop_word[1:])}  # vLLM's: the token id that ended it
    chat = alice.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=8, temperature=0, extra_body={"stop_token_ids": [0]})
    assert chat.choices[0].model_extra == {"stop_reason": None if chat.choices[0].finish_reason == "length" else 0}


def _texts(server: ServerProcess, body: dict[str, Any]) -> tuple[str, str]:
    """The completion's text, unstreamed and streamed."""
    url, headers = f"{server.base_url}/completions", {"Authorization": "Bearer key-alice"}
    whole = httpx.post(url, headers=headers, json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream("POST", url, headers=headers, json=body | {"stream": True}, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    return whole, "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_include_stop_str_in_output(server: ServerProcess,
                                                                          include: bool) -> None:
    """vLLM's detokenizer leaves out the text of the token that stopped a request (one of
    `stop_token_ids`, or EOS: visible with `skip_special_tokens: false`) unless
    `include_stop_str_in_output`; streamed and unstreamed texts agree."""
    full, _ = _texts(server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    words = full.split()
    stop_word = words[2]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "include_stop_str_in_output": include,
            "stop_token_ids": [int(stop_word[1:])], "skip_special_tokens": False}
    whole, streamed = _texts(server, body)
    assert whole == streamed and whole.split() == words[:words.index(stop_word) + include]
    eos = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "include_stop_str_in_output": include,
           "logit_bias": {"1": 100}, "skip_special_tokens": False}  # token 1 is the tiny tokenizer's </s>
    whole, streamed = _texts(server, eos)
    assert whole == streamed and whole.split() == (["</s>"] if include else [])


def _n_choices(client: openai.OpenAI, server: ServerProcess, seed: int) -> list[str]:
    out = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=10, temperature=1.0,
                                    seed=seed, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage is not None and out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 30
    return [c.text for c in out.choices]


def test_seeded_n_is_reproducible_and_each_choice_is_seed_plus_index(server: ServerProcess, alice: openai.OpenAI,
                                                                      bob: openai.OpenAI, offline: LLM) -> None:
    first = _n_choices(alice, server, seed=7)
    assert _n_choices(bob, server, seed=7) == first
    assert len(set(first)) == 3
    expected = [offline.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i))[0].text
                for i in range(3)]
    assert first == expected


def test_chat_n_with_logprobs(server: ServerProcess, alice: openai.OpenAI) -> None:
    out = alice.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": PROMPT}],
                                        max_tokens=4, temperature=1.0, seed=3, n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 4
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        assert "".join(e.token for e in choice.logprobs.content) == choice.message.content.replace(" ", "")


def test_streamed_n_choices_equal_the_whole_response(server: ServerProcess, alice: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    whole = alice.chat.completions.create(model=server.model_name, messages=messages, max_tokens=6,
                                          temperature=0.8, seed=11, n=2)
    texts = {0: "", 1: ""}
    finishes = {}
    roles = set()
    for chunk in alice.chat.completions.create(model=server.model_name, messages=messages, max_tokens=6,
                                               temperature=0.8, seed=11, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1} and finishes == {0: "length", 1: "length"}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_audit_records_features_used_not_content(server: ServerProcess) -> None:
    # greedy (temperature is not an audited feature): a sampled choice could end on EOS after one token
    body = {"prompt": PROMPT, "max_tokens": 2, "n": 2, "logit_bias": {"77": 1.0}, "presence_penalty": 0.3,
            "temperature": 0}
    response = httpx.post(f"{server.base_url}/completions", json=body,
                          headers={"Authorization": "Bearer key-alice"}, timeout=60)
    assert response.status_code == 200
    record = server.audit_for(response.headers["x-request-id"])
    assert record["features"] == ["n", "presence_penalty", "logit_bias"]
    assert record["output_tokens"] == 4, "both choices' tokens are counted"
    assert "logit_bias" not in {k for k in record if k != "features"} and '"77"' not in json.dumps(record)


def test_allowed_token_ids_over_http(server: ServerProcess, alice: openai.OpenAI, offline: LLM) -> None:
    """vLLM's allowed_token_ids: every sampled token is one of them, as offline; one outside
    the vocabulary is a 400 naming the field."""
    allowed = [40, 41, 77]
    out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=10, temperature=1.5, seed=2,
                                   extra_body={"allowed_token_ids": allowed})
    words = out.choices[0].text.split()
    assert words and all(w in ("w40", "w41", "w77") for w in words)
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.5, seed=2,
                                                       allowed_token_ids=allowed))[0]
    assert out.choices[0].text == expected.text
    response = httpx.post(f"{server.base_url}/completions", json={"prompt": PROMPT, "allowed_token_ids": [40, 600]},
                          headers={"Authorization": "Bearer key-alice"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_token_ids"
