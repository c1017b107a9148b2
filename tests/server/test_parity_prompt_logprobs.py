"""OpenAI parity over HTTP: completions' `echo` (with logprobs, and with max_tokens 0), and
vLLM's `prompt_logprobs` on completions and chat, equal to the offline engine on the same
weights (itself checked against transformers, `tests/engine/test_prompt_logprobs.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_process import ServerProcess

from kvseal.llm import LLM
from kvseal.types import RequestOutput, SamplingParams

PROMPT = "w10 w11 w12 w13 w14"
ATOL = 1e-4


@pytest.fixture(scope="module")
def offline(server_model_dir: Path) -> LLM:
    return LLM(str(server_model_dir), dtype="float32", kv_cache_tokens=2048, page_size=4, max_model_len=512)


def reference(offline: LLM, prompt: str | list[int], max_tokens: int = 4, num_top: int = 2) -> RequestOutput:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=num_top, prompt_logprobs=num_top)
    return offline.generate(prompt, params)[0]


def post(server: ServerProcess, path: str, body: dict[str, Any], key: str = "key-alice") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_echo_with_logprobs_puts_the_prompt_first(server: ServerProcess, alice: openai.OpenAI, offline: LLM) -> None:
    out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                   logprobs=2)
    expected = reference(offline, PROMPT)
    [choice] = out.choices
    assert choice.text == PROMPT + expected.text
    lps = choice.logprobs
    assert lps is not None and lps.token_logprobs is not None and lps.tokens is not None
    num_prompt = len(expected.prompt_token_ids)
    token_text = offline.get_tokenizer().decode
    assert lps.tokens == [token_text([t]) for t in expected.prompt_token_ids + expected.token_ids]
    assert lps.token_logprobs[0] is None and lps.top_logprobs is not None and lps.top_logprobs[0] is None
    engine_prompt = expected.prompt_token_logprobs
    assert engine_prompt is not None and expected.logprobs is not None
    wanted = [lp.logprob for lp in engine_prompt[1:]] + [lp.logprob for lp in expected.logprobs]
    assert lps.token_logprobs[1:] == pytest.approx(wanted, abs=ATOL)
    for ours, entry in zip(lps.top_logprobs[1:num_prompt], engine_prompt[1:]):
        assert entry is not None
        top = {token_text([t]): v for t, v in entry.top}
        top.setdefault(token_text([entry.token_id]), entry.logprob)  # the prompt's own token, as OpenAI's always is
        assert ours == pytest.approx(top, abs=ATOL)
    assert lps.text_offset is not None and lps.text_offset[0] == 0
    # one offset per token, across the prompt into the output (this word-level tokenizer's tokens
    # carry no spaces, so the offsets count its tokens' own characters)
    assert len(lps.text_offset) == len(lps.tokens) and lps.text_offset == sorted(set(lps.text_offset))
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_echo_without_logprobs_and_of_token_ids(server: ServerProcess, alice: openai.OpenAI, offline: LLM) -> None:
    ids = offline.get_tokenizer()(PROMPT)["input_ids"]
    out = alice.completions.create(model=server.model_name, prompt=ids, max_tokens=3, temperature=0, echo=True)
    expected = reference(offline, ids, max_tokens=3)
    assert out.choices[0].text == offline.get_tokenizer().decode(ids) + expected.text
    assert out.choices[0].logprobs is None


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server: ServerProcess, alice: openai.OpenAI,
                                                         offline: LLM) -> None:
    """lm-evaluation-harness scores a text this way: the prompt's logprobs, nothing generated
    into the answer (vLLM runs one token and drops it: it is counted in usage)."""
    out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=0, temperature=0, echo=True,
                                   logprobs=1)
    expected = reference(offline, PROMPT, num_top=1)
    [choice] = out.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert expected.prompt_token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(expected.prompt_token_ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [lp.logprob for lp in expected.prompt_token_logprobs[1:] if lp is not None], abs=ATOL)


def test_max_tokens_0_without_echo_is_refused(server: ServerProcess) -> None:
    response = post(server, "/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "echo" in error["message"]


def test_streamed_echo_equals_the_whole_response(server: ServerProcess, alice: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=server.model_name, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                  logprobs=2, n=2)
    whole = alice.completions.create(**fields)
    for max_tokens in (5, 0):
        if max_tokens == 0:
            fields["max_tokens"] = 0
            whole = alice.completions.create(**fields)
        texts, tokens, offsets = ["", ""], [[], []], [[], []]  # type: ignore[var-annotated]
        for chunk in alice.completions.create(**fields, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.text
                assert c.logprobs is not None
                tokens[c.index] += c.logprobs.tokens or []
                offsets[c.index] += c.logprobs.text_offset or []
        for choice in whole.choices:
            assert choice.logprobs is not None
            assert texts[choice.index] == choice.text and texts[choice.index].startswith(PROMPT)
            assert tokens[choice.index] == choice.logprobs.tokens
            assert offsets[choice.index] == choice.logprobs.text_offset


def test_completions_prompt_logprobs_in_vllms_shape(server: ServerProcess, offline: LLM) -> None:
    response = post(server, "/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                             "prompt_logprobs": 2, "n": 2})
    assert response.status_code == 200, response.text
    expected = reference(offline, PROMPT, max_tokens=3)
    assert expected.prompt_logprobs is not None
    for choice in response.json()["choices"]:
        assert choice["text"] == expected.text, "prompt_logprobs alone does not echo"
        assert_vllm_shape(choice["prompt_logprobs"], expected)


def test_chat_prompt_logprobs_in_vllms_shape(server: ServerProcess, offline: LLM) -> None:
    messages = [{"role": "user", "content": "w20 w21"}]
    response = post(server, "/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0,
                                                  "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    ids = offline.apply_chat_template(messages)
    assert_vllm_shape(response.json()["prompt_logprobs"], reference(offline, ids, max_tokens=3))


def assert_vllm_shape(body: list[dict[str, Any] | None], expected: RequestOutput) -> None:
    assert expected.prompt_logprobs is not None and body[0] is None and len(body) == len(expected.prompt_logprobs)
    for ours, theirs in zip(body[1:], expected.prompt_logprobs[1:]):
        assert ours is not None and theirs is not None
        assert [int(t) for t in ours] == list(theirs), "the prompt token first, then the top alternatives"
        for token, entry in ours.items():
            lp = theirs[int(token)]
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=ATOL)
            assert (entry["rank"], entry["decoded_token"]) == (lp.rank, lp.decoded_token)


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_prompt_logprobs_are_not_streamed(server: ServerProcess, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "prompt_logprobs": 1, "stream": True}
    body |= {"prompt": PROMPT} if path == "/completions" else {"messages": [{"role": "user", "content": "w1"}]}
    response = post(server, path, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("value", [21, -1, 1.5, "2"])
def test_prompt_logprobs_out_of_range_is_refused(server: ServerProcess, value: object) -> None:
    response = post(server, "/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": value})
    assert response.status_code == 400 and "prompt_logprobs" in response.text


def test_audit_records_echo_and_prompt_logprobs_by_name(server: ServerProcess) -> None:
    response = post(server, "/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
                                             "prompt_logprobs": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    record = server.audit_for(response.headers["x-request-id"])
    assert record["features"] == ["logprobs", "echo", "prompt_logprobs"]
    assert "w10" not in json.dumps({k: v for k, v in record.items() if k != "prompt"})
