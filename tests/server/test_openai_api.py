"""The official openai client against the real server: completions, chat, streaming, stops."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from processes import wait_for
from server_process import ServerProcess

import kvseal
from kvseal.llm import LLM
from kvseal.types import SamplingParams

PROMPT = "w10 w11 w12 w13 w14"


@pytest.fixture(scope="module")
def offline(server_model_dir: Path) -> LLM:
    """The same model through the offline engine: the reference for greedy outputs."""
    return LLM(str(server_model_dir), dtype="float32", kv_cache_tokens=2048, page_size=4, max_model_len=512)


def test_models_and_health(server: ServerProcess, alice: openai.OpenAI) -> None:
    assert [m.id for m in alice.models.list()] == [server.model_name]
    assert alice.models.retrieve(server.model_name).id == server.model_name
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_vllm_probe_routes(server: ServerProcess) -> None:
    """vLLM's /ping (GET and POST, no key: SageMaker's health check), /version (any key) and
    /load (an admin key: it counts every tenant's requests), and its model card's fields."""
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.url}/ping").json() == {"status": "ok"}
    alice, ops = ({"Authorization": f"Bearer {key}"} for key in ("key-alice", "key-ops"))
    assert httpx.get(f"{server.url}/version").status_code == 401
    assert httpx.get(f"{server.url}/version", headers=alice).json() == {"version": kvseal.__version__}
    assert httpx.get(f"{server.url}/load").status_code == 401
    refused = httpx.get(f"{server.url}/load", headers=alice)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sending:
        # a request whose body is still on its way: in the server from its key's check on
        sending.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-alice\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        wait_for(lambda: httpx.get(f"{server.url}/load", headers=ops).json()["server_load"] == 1,
                 "the half-sent request to count")
    wait_for(lambda: httpx.get(f"{server.url}/load", headers=ops).json()["server_load"] == 0,
             "the abandoned request to end")
    card = httpx.get(f"{server.url}/v1/models", headers=alice).json()["data"][0]
    assert card["root"] == server.model_name and card["parent"] is None
    assert "/" not in card["root"]  # a name, never the server's path to the model
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]


def test_completion_equals_offline_engine(server: ServerProcess, alice: openai.OpenAI, offline: LLM) -> None:
    out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    choice = out.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 12)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == server.model_name


def test_completion_stream_with_usage(server: ServerProcess, alice: openai.OpenAI) -> None:
    full = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=10, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.total_tokens == 15
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(server: ServerProcess) -> None:
    body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer key-alice"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_chat_equals_offline_and_stream(server: ServerProcess, alice: openai.OpenAI, offline: LLM) -> None:
    messages: list[Any] = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32"}]
    out = alice.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8, temperature=0)
    expected = offline.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    stream = list(alice.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
    assert stream[-1].usage is not None and stream[-1].usage.completion_tokens == 8
    continuous = list(alice.chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    prompt_tokens = stream[-1].usage.prompt_tokens
    assert continuous[0].usage is not None and continuous[0].choices[0].delta.role == "assistant"
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in continuous[:2] if c.usage] == [
        (prompt_tokens, 0), (prompt_tokens, 1)], "the role chunk before any token, then the first token's"
    assert continuous[-2].usage is not None and continuous[-2].usage.completion_tokens == 8


def test_chat_text_parts_and_max_completion_tokens(server: ServerProcess, alice: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "w30 w31 w32"}]}]
    out = alice.chat.completions.create(model=server.model_name, messages=messages, max_completion_tokens=5,
                                        temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 5


def test_stop_string_cuts_the_text(server: ServerProcess, alice: openai.OpenAI) -> None:
    full = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    words = full.choices[0].text.split()
    stop = words[3]
    cut = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.index(stop)]
    assert cut.choices[0].model_extra == {"stop_reason": stop}  # vLLM's: the stop string that ended it
    assert full.choices[0].model_extra == {"stop_reason": None}  # (ended by its length)
    streamed = list(alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                             stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    assert [c.choices[0].model_extra for c in streamed][-1] == {"stop_reason": stop}
    kept = {"include_stop_str_in_output": True}  # vLLM's: the stop string stays, what follows goes
    with_stop = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                         stop=[stop], extra_body=kept)
    assert with_stop.choices[0].finish_reason == "stop" and with_stop.choices[0].text == cut.choices[0].text + stop
    streamed = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                        stop=stop, stream=True, extra_body=kept)
    assert "".join(c.choices[0].text for c in streamed) == with_stop.choices[0].text


def test_seed_makes_sampling_reproducible(server: ServerProcess, alice: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                       top_p=0.9, seed=seed)
        return out.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(1, 5)}) > 1


def test_vllm_extensions(server: ServerProcess, alice: openai.OpenAI) -> None:
    out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True, "min_tokens": 6, "top_k": 5})
    assert out.usage is not None and out.usage.completion_tokens == 6


def test_min_p_one_keeps_only_the_most_likely_token(server: ServerProcess, alice: openai.OpenAI) -> None:
    """vLLM's min_p: min_p=1 keeps only tokens as likely as the most likely one, so sampling at
    temperature 1 gives the greedy text; min_p outside [0, 1] is a 400 naming it."""
    def text(**extra: object) -> str:
        out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=8, extra_body=extra)
        return out.choices[0].text

    greedy = text(temperature=0, ignore_eos=True)
    assert {text(temperature=1.0, min_p=1.0, seed=s, ignore_eos=True) for s in range(3)} == {greedy}
    for bad in (1.5, -0.1):
        with pytest.raises(openai.BadRequestError) as info:
            text(min_p=bad)
        assert info.value.status_code == 400 and "min_p" in str(info.value.body)


def test_skip_special_tokens_false_shows_them(server: ServerProcess, alice: openai.OpenAI) -> None:
    """vLLM's skip_special_tokens: false puts </s> (forced here) in the text; the default skips it."""
    forced = {"ignore_eos": True, "logit_bias": {"1": 100}}  # token 1 is the tiny tokenizer's </s>

    def text(**extra: object) -> str:
        out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=2, temperature=0,
                                       extra_body=forced | extra)
        return out.choices[0].text

    assert text() == "" and text(skip_special_tokens=False).split() == ["</s>", "</s>"]


@pytest.mark.parametrize("chat", [False, True])
def test_a_token_without_text_still_gets_its_chunk(server: ServerProcess, alice: openai.OpenAI, chat: bool) -> None:
    """As vLLM's streams: one chunk per step that made a token, even when its text is empty (a
    skipped special token, here </s> forced past ignore_eos) or held back, so a client counting
    chunks sees every token."""
    forced = {"ignore_eos": True, "logit_bias": {"1": 100}}
    if chat:
        chunks = [c for c in alice.chat.completions.create(
            model=server.model_name, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0,
            stream=True, extra_body=forced) if c.choices and c.choices[0].delta.role is None]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    else:
        chunks = [c for c in alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=4,
                                                      temperature=0, stream=True, extra_body=forced) if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == ""
    assert len(chunks) == 4 and chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs(server: ServerProcess, alice: openai.OpenAI) -> None:
    out = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob)  # greedy: the best token
        assert top[token] == pytest.approx(logprob)
    assert " ".join(lp.tokens) == out.choices[0].text.strip()
    # the position's own token is always there (OpenAI's legacy shape: up to logprobs + 1 entries)
    sampled = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=5, temperature=1.5,
                                       seed=3, logprobs=0).choices[0].logprobs
    assert sampled is not None and sampled.tokens is not None and sampled.top_logprobs is not None
    assert [list(top) for top in sampled.top_logprobs] == [[token] for token in sampled.tokens]
    assert [top[token] for top, token in zip(sampled.top_logprobs, sampled.tokens)] == sampled.token_logprobs


def test_chat_logprobs(server: ServerProcess, alice: openai.OpenAI) -> None:
    out = alice.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "w40"}],
                                        max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes or []) == entry.token.encode()


def test_prompt_as_token_ids(server: ServerProcess, alice: openai.OpenAI) -> None:
    by_text = alice.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = alice.completions.create(model=server.model_name, prompt=[10, 11, 12, 13, 14], max_tokens=4,
                                      temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
