"""Incremental detokenization in the engine (`engine/output.py`): the Rust backend's decode
stands in for the Hugging Face wrapper's where that gives the same string, and a stream's
pieces add up to the whole text."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tiny_models import make_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvseal.engine.output import OutputState, text_decoder
from kvseal.types import Request, SamplingParams

TEXT = ["naïve café 東京 déjà vu — ünïcödé 🙂 and plain words", "the quick brown fox 𝄞 jumps over the lazy dog"] * 20


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE (GPT-2 / Llama-3 style): multi-byte characters span tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(params=["word_level", "byte_level"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return make_tokenizer() if request.param == "word_level" else byte_level_tokenizer()


def test_the_backend_decodes_as_the_wrapper_does_without_calling_it(tokenizer: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert tokenizer.clean_up_tokenization_spaces is False
    rng = random.Random(0)
    cases = [rng.choices(range(len(tokenizer)), k=rng.randint(0, 12)) for _ in range(200)]
    cases += [[tokenizer.bos_token_id, *tokenizer.encode("déjà vu", add_special_tokens=False),
               tokenizer.eos_token_id]]
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in cases]

    def wrapper_called(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("the fast path went through the wrapper")

    monkeypatch.setattr(tokenizer, "decode", wrapper_called)
    decode = text_decoder(tokenizer)
    assert [decode(ids) for ids in cases] == expected


def test_a_tokenizer_that_cleans_up_text_keeps_the_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = make_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    calls: list[list[int]] = []
    plain = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(ids) or plain(ids, **kw))
    assert text_decoder(tokenizer)([5, 6]) == plain([5, 6], skip_special_tokens=True)
    assert calls == [[5, 6]]


@pytest.mark.parametrize(("make", "prompt", "text"), [
    (make_tokenizer, "w1 w2", "w3 w4 w5 w6 w7"),
    (byte_level_tokenizer, "plain", " ".join(TEXT[:2])),
])
def test_streamed_pieces_add_up_to_the_whole_text(make: Any, prompt: str, text: str) -> None:
    tokenizer = make()
    output = tokenizer.encode(text, add_special_tokens=False)
    request = Request("r", "t", tokenizer.encode(prompt, add_special_tokens=False),
                      SamplingParams(max_tokens=len(output)))
    state = OutputState(request, text_decoder(tokenizer), eos_token_ids=())
    pieces = []
    for token in output:
        state.append_token(token)
        pieces.append(state.report(finished=False).new_text)
        assert "\ufffd" not in pieces[-1]  # a character split across tokens is held back whole
    pieces.append(state.report(finished=True).new_text)
    assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_is_cut_or_kept_and_what_follows_it_goes(include: bool) -> None:
    """A matched stop string ends the text; `include_stop_str_in_output` (vLLM's) keeps it. Either
    way, the streamed pieces add up to the final text and nothing after the match is shown."""
    tokenizer = make_tokenizer()
    output = tokenizer.encode("w3 w4 w5 w6 w7", add_special_tokens=False)
    whole = tokenizer.decode(output, skip_special_tokens=True)
    stop = "w5 w"
    request = Request("r", "t", tokenizer.encode("w1 w2", add_special_tokens=False),
                      SamplingParams(max_tokens=len(output), stop=(stop,), include_stop_str_in_output=include))
    state = OutputState(request, text_decoder(tokenizer), eos_token_ids=())
    pieces = []
    for token in output:
        state.append_token(token)
        pieces.append(state.report(finished=request.finish_reason is not None).new_text)
        if request.finish_reason is not None:
            break
    end = whole.index(stop) + (len(stop) if include else 0)
    assert request.finish_reason == "stop" and request.stop_reason == stop
    assert state.text == whole[:end] and "".join(pieces) == whole[:end]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop_by", ["stop_token_ids", "eos"])
def test_the_token_that_ends_a_request_leaves_its_text_unless_asked(include: bool, stop_by: str) -> None:
    """vLLM's detokenizer leaves out the text of a stop token (one of `stop_token_ids`, or EOS:
    seen with `skip_special_tokens=False`) unless `include_stop_str_in_output`; its id stays.
    The streamed pieces add up to the same text."""
    tokenizer = make_tokenizer()
    words = tokenizer.encode("w3 w4", add_special_tokens=False)
    stop_id = tokenizer.eos_token_id if stop_by == "eos" else tokenizer.convert_tokens_to_ids("w5")
    output = [*words, stop_id]
    params = SamplingParams(max_tokens=8, include_stop_str_in_output=include, skip_special_tokens=False,
                            stop_token_ids=(stop_id,) if stop_by == "stop_token_ids" else ())
    prompt = tokenizer.encode("w1 w2", add_special_tokens=False)
    request = Request("r", "t", prompt, params)
    state = OutputState(request, text_decoder(tokenizer, skip_special_tokens=False),
                        eos_token_ids=(tokenizer.eos_token_id,))
    pieces = []
    for token in output:
        state.append_token(token)
        pieces.append(state.report(finished=request.finish_reason is not None).new_text)
    kept = output if include else words
    expected = tokenizer.decode(prompt + kept, skip_special_tokens=False)[len(tokenizer.decode(prompt)):]
    assert request.finish_reason == "stop" and request.output_token_ids == output
    assert state.text == expected and "".join(pieces) == expected
    assert state.text.endswith(tokenizer.convert_ids_to_tokens(stop_id)) is include
