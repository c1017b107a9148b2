"""Several prompts in one completions request, as OpenAI and vLLM take them: choice k is choice
k % n of prompt k // n, each prompt admitted (I1) and counted on its own, one audit record and
one usage for the request, streamed as the whole response."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from processes import wait_for
from server_process import KEYS, MAX_MODEL_LEN, ServerProcess

PROMPTS = ["w10 w11 w12", "w20 w21", "w30 w31 w32 w33"]


def post(server: ServerProcess, body: dict[str, Any], key: str = "key-alice") -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def alone(alice: openai.OpenAI, server: ServerProcess, prompt: str | list[int], **fields: Any) -> Any:
    return alice.completions.create(model=server.model_name, prompt=prompt, temperature=0,
                                    **({"max_tokens": 5} | fields))


def test_each_prompts_choices_equal_it_sent_alone(server: ServerProcess, alice: openai.OpenAI) -> None:
    out = alice.completions.create(model=server.model_name, prompt=PROMPTS, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    singles = [alone(alice, server, p) for p in PROMPTS]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage) == 9
    assert out.usage.completion_tokens == 30


def test_token_id_prompts_and_echo(server: ServerProcess, alice: openai.OpenAI) -> None:
    ids = [[5, 6, 7], [40, 41]]
    out = alice.completions.create(model=server.model_name, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                   logprobs=1)
    for choice, prompt in zip(out.choices, ids):
        single = alone(alice, server, prompt, max_tokens=3, echo=True, logprobs=1).choices[0]
        assert choice.text == single.text and choice.logprobs is not None and single.logprobs is not None
        assert choice.logprobs.tokens == single.logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(single.logprobs.token_logprobs, abs=1e-4)
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(prompt) + 3


def test_several_prompts_stream_as_the_whole_response(server: ServerProcess, alice: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=server.model_name, prompt=PROMPTS, max_tokens=6, temperature=0.9, seed=3,
                                  n=2)
    whole = alice.completions.create(**fields)
    texts = [""] * 6
    usage = None
    for chunk in alice.completions.create(**fields, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices]
    assert usage is not None and whole.usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens


def test_continuous_usage_gives_each_chunk_its_choices_usage_so_far(server: ServerProcess,
                                                                     alice: openai.OpenAI) -> None:
    """vLLM's `continuous_usage_stats`: every chunk of choice k carries the tokens of prompt
    k // n and those choice k has generated so far; the last chunk is the request's usage."""
    chunks = list(alice.completions.create(
        model=server.model_name, prompt=PROMPTS, max_tokens=6, temperature=0.9, seed=3, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True}))
    *per_choice, last = chunks
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (9, 36)
    seen: dict[int, list[int]] = {}
    for chunk in per_choice:
        [choice] = chunk.choices
        assert chunk.usage is not None and chunk.usage.prompt_tokens == [3, 2, 4][choice.index // 2]
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        seen.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
    assert sorted(seen) == list(range(6))
    for counts in seen.values():
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6, counts
    without = list(alice.completions.create(model=server.model_name, prompt=PROMPTS[0], max_tokens=2, stream=True,
                                            stream_options={"continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    assert all(c.usage is None for c in without), "as vLLM: only with include_usage"


def test_one_audit_record_counts_every_prompt_once(server: ServerProcess) -> None:
    response = post(server, {"prompt": PROMPTS, "max_tokens": 2, "n": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    record = server.audit_for(response.headers["x-request-id"])
    assert (record["prompt_tokens"], record["output_tokens"], record["outcome"]) == (9, 12, "finished")


def test_one_prompt_that_cannot_fit_refuses_the_request(server: ServerProcess) -> None:
    """Every prompt is admitted before any reaches the engine: one too long is a 400, and the
    others never ran."""
    too_long = " ".join(f"w{i % 400}" for i in range(600))
    response = post(server, {"prompt": [PROMPTS[0], too_long], "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    record = server.audit_for(response.headers["x-request-id"])
    assert record["outcome"] == "rejected" and record.get("output_tokens") is None


def test_a_prompt_the_engine_refuses_ends_the_request_as_that_refusal(server_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    """With the front door's admission off (`Fault.SKIP_FRONT_DOOR_ADMISSION`), the engine refuses
    the second prompt's choices while the first one's run: the client gets the 400, the running
    choices are aborted as its consequence (no client left), the audit says the refusal with both
    prompts' tokens and what ran, and every page is free again."""
    unguarded = ServerProcess(server_model_dir, tmp_path, keys=KEYS, faults=["skip_front_door_admission"]).start()
    try:
        for stream in (False, True):
            response = post(unguarded, {"prompt": [[5, 6, 7], [7] * (MAX_MODEL_LEN + 1)], "n": 2,
                                        "max_tokens": 200, "ignore_eos": True, "stream": stream})
            body = json.loads(response.text.split("data: ")[-2]) if stream else response.json()
            assert body["error"]["code"] == "context_length_exceeded" and response.status_code == (
                200 if stream else 400), response.text
            record = unguarded.audit_for(response.headers["x-request-id"])
            assert (record["outcome"], record["reason"], record.get("http_status"), record["prompt_tokens"]) == (
                "rejected", "context_length_exceeded", 400, 3 + MAX_MODEL_LEN + 1), record
            wait_for(lambda: unguarded.metric("kvseal_kv_pages_used") == 0, "every page free again")
        assert "client_disconnected" not in unguarded.log()
    finally:
        assert unguarded.terminate() == 0


def test_every_prompts_choices_take_the_tenants_slots(server: ServerProcess) -> None:
    """Three prompts are three requests in flight: over a limit of one, a 429 that says why."""
    response = post(server, {"prompt": PROMPTS, "max_tokens": 2}, key="key-limited")
    assert response.status_code == 429, response.text
    assert "3 choices" in response.json()["error"]["message"]
    assert post(server, {"prompt": PROMPTS[:1], "max_tokens": 2}, key="key-limited").status_code == 200


def test_audit_log_prompts_keep_every_prompt(server: ServerProcess) -> None:
    response = post(server, {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 1})
    assert response.status_code == 200, response.text
    record = server.audit_for(response.headers["x-request-id"])
    assert record["prompt_tokens"] == 5
    assert "prompt" not in record or json.dumps(record["prompt"]) == "[[5, 6], [7, 8, 9]]"
