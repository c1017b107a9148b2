"""Sampling, stop conditions, abort, and determinism across batch compositions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tiny_models import EOS_ID, words

from kvseal import FinishReason, SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.types import RequestOutput

PROMPT = list(range(20, 32))
OTHERS = [list(range(50, 90)), [7, 8], list(range(120, 133))]


def test_seeded_sampling_is_independent_of_batch_and_preemption(make_llm: Callable[..., Any]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = make_llm().generate([PROMPT], params)[0].token_ids
    batched = make_llm(max_num_batched_tokens=7).generate([*OTHERS, PROMPT], params)[-1].token_ids
    tight = make_llm(kv_cache_tokens=72, max_model_len=72)
    preempted = tight.generate([*OTHERS, PROMPT], params)[-1].token_ids
    assert tight.engine.stats().num_preemptions > 0
    assert alone == batched == preempted


def test_different_seeds_differ_and_unseeded_requests_vary(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    outs = llm.generate([PROMPT] * 4, [SamplingParams(max_tokens=12, temperature=1.5, seed=s, ignore_eos=True)
                                       for s in (1, 2, None, None)])
    assert len({tuple(o.token_ids) for o in outs}) == 4


def test_top_k_one_equals_greedy(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    top1 = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True))[0]
    assert greedy.token_ids == top1.token_ids


def test_stop_string_is_cut_and_reported(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    full = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    third = words([full.token_ids[3]])
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[third]))[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == third
    assert third not in out.text and out.text == full.text[: full.text.index(third)]
    assert len(out.token_ids) == full.token_ids.index(full.token_ids[3]) + 1


def test_stop_token_ids_and_min_tokens(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    full = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_id = full.token_ids[1]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop_id and len(out.token_ids) == 2
    late = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id],
                                                 min_tokens=5))[0]
    assert len(late.token_ids) >= 5 and stop_id not in late.token_ids[:5]


def test_eos_stops_unless_ignored(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    tokenizer_eos = llm.get_tokenizer().eos_token_id
    assert tokenizer_eos == EOS_ID and EOS_ID in llm.engine.model_config.eos_token_ids
    outs = llm.generate([PROMPT] * 16, [SamplingParams(max_tokens=40, temperature=5.0, seed=s) for s in range(16)])
    assert any(out.finish_reason is FinishReason.STOP for out in outs), "seeds chosen so that some draw EOS"
    ignoring = llm.generate([PROMPT] * 16, [SamplingParams(max_tokens=40, temperature=5.0, seed=s, ignore_eos=True)
                                            for s in range(16)])
    assert all(len(out.token_ids) == 40 for out in ignoring)
    for out in outs:
        if out.finish_reason is FinishReason.STOP:
            assert out.token_ids[-1] == EOS_ID and EOS_ID not in out.token_ids[:-1]
        else:
            assert len(out.token_ids) == 40 and EOS_ID not in out.token_ids


def _abort_the_running_request(engine: Any) -> RequestOutput | None:
    engine.add_request("running", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("queued", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv.num_used_pages > 0
    return engine.abort("running", "client went away")


def test_abort_frees_pages_at_once_for_running_and_queued(make_llm: Callable[..., Any]) -> None:
    engine = make_llm(max_num_seqs=1).engine
    aborted = _abort_the_running_request(engine)
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT and aborted.error == "client went away"
    assert engine.kv.num_used_pages == 0
    assert engine.abort("queued") is not None and not engine.has_unfinished()
    assert engine.abort("unknown") is None
    engine.check_integrity()


def test_the_abort_test_fails_when_an_abort_keeps_its_pages(make_llm: Callable[..., Any]) -> None:
    """The negative control of the test above (I6): with the fault, the abort still reports the
    request ended with its error, and the page count is what shows the pages were not freed."""
    engine = make_llm(max_num_seqs=1).engine
    with inject(Fault.ABORT_KEEPS_PAGES):
        aborted = _abort_the_running_request(engine)
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert engine.kv.num_used_pages > 0 and engine.has_unfinished()


def test_chat_applies_the_template(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    out = llm.chat([{"role": "user", "content": "w100 w101"}], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == [3, 100, 101, 4, 5]


def test_text_prompt_round_trip(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    by_text = llm.generate("w20 w21 w22", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    by_ids = llm.generate([[20, 21, 22]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert by_text.token_ids == by_ids.token_ids and by_text.text == " " + words(by_ids.token_ids)


def test_underflowing_top_p_and_temperature_sample_the_top_token(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    for params in (SamplingParams(max_tokens=5, top_p=5e-324, ignore_eos=True, seed=1),
                   SamplingParams(max_tokens=5, temperature=1e-40, ignore_eos=True, seed=1)):
        assert llm.generate([PROMPT], params)[0].token_ids == greedy.token_ids


def test_outputs_report_pages_reserved_and_kv_written(make_llm: Callable[..., Any]) -> None:
    out = make_llm(page_size=4).generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    # 12 prompt + 5 computed output tokens (the last sampled token is never fed back).
    assert out.num_kv_tokens_written == 17 and out.num_pages_reserved == 5
