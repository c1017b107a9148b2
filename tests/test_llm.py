"""The offline API (`kvseal.llm.LLM`) as a vLLM user calls it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from char_model import make_char_model
from tiny_models import make_tokenizer

from kvseal import InvalidParameter, SamplingParams
from kvseal.errors import ConfigError, ModelLoadError
from kvseal.types import StructuredOutputsParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_a_failing_step_leaves_the_engine_clean_and_usable(make_llm: Callable[..., Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises mid-call (here the model runner) aborts the call's requests: no page
    stays held and the next call runs (before, the requests stayed queued and the next
    call could step them forever)."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    free_before = llm.engine.kv.num_free_pages
    expected = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    run = llm.engine.runner.run

    def fail_once(batch: Any) -> Any:
        monkeypatch.setattr(llm.engine.runner, "run", run)
        raise RuntimeError("test: the forward failed")

    monkeypatch.setattr(llm.engine.runner, "run", fail_once)
    with pytest.raises(RuntimeError, match="the forward failed"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_pages == free_before
    llm.engine.check_integrity()
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == expected


def test_an_interrupt_between_two_prompts_leaves_nothing_queued(make_llm: Callable[..., Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while a batch is being queued (here as the second prompt is added) takes the
    prompts already queued back out: before, the first stayed, and the next call ran it."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    free_before = llm.engine.kv.num_free_pages
    add = llm.engine.add_request
    calls = []

    def interrupted_on_the_second(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", interrupted_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY)
    assert len(calls) == 2 and not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_pages == free_before
    llm.engine.check_integrity()


def test_vllm_prompt_dicts_are_the_prompts_they_hold(make_llm: Callable[..., Any]) -> None:
    """{"prompt_token_ids": [...]} and {"prompt": "..."} (vLLM's TokensPrompt and TextPrompt) run
    those tokens; a lone dict used to be read as the list of its keys, i.e. the text
    "prompt_token_ids", and silently generate from that."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    expected = [o.token_ids for o in llm.generate([[5, 6, 7], "w8 w9"], GREEDY)]
    one = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    both = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "w8 w9"}], GREEDY)
    assert [o.token_ids for o in one] == expected[:1]
    assert [o.prompt_token_ids for o in one] == [[5, 6, 7]]
    assert [o.token_ids for o in both] == expected


@pytest.mark.parametrize("prompt", [{"prompt": "w8", "prompt_token_ids": [8]}, {"multi_modal_data": {}}, {}])
def test_other_prompt_dicts_are_refused(make_llm: Callable[..., Any], prompt: dict[str, Any]) -> None:
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    with pytest.raises(InvalidParameter) as info:
        llm.generate([[5, 6], prompt], GREEDY)
    assert info.value.param == "prompt"
    assert not llm.engine.has_unfinished()


def test_n_choices_come_back_as_outputs(make_llm: Callable[..., Any]) -> None:
    """SamplingParams(n=3) gives three choices in `outputs` (vLLM's shape), each seeded seed + i
    as the HTTP API does; before, offline generate ran one choice and dropped n silently."""
    llm = make_llm(kv_cache_tokens=256, max_model_len=64)
    free_before = llm.engine.kv.num_free_pages
    params = SamplingParams(n=3, max_tokens=6, seed=11, ignore_eos=True, logprobs=0)
    [out] = llm.generate("w8 w9", params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [llm.generate("w8 w9", SamplingParams(max_tokens=6, seed=11 + i, ignore_eos=True))[0]
               for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    assert [c.text for c in out.outputs] == [s.text for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert (out.token_ids, out.text) == (out.outputs[0].token_ids, out.outputs[0].text)
    assert out.prompt == "w8 w9" and out.request_id.startswith("offline-") and out.finished
    for choice in out.outputs:
        assert choice.logprobs is not None and len(choice.logprobs) == 6
        assert choice.cumulative_logprob == pytest.approx(
            sum(step[token].logprob for step, token in zip(choice.logprobs, choice.token_ids)))
        assert choice.finish_reason == "length"
    assert llm.engine.kv.num_free_pages == free_before


def test_one_choice_is_outputs_zero(make_llm: Callable[..., Any]) -> None:
    """`out.outputs[0].text` (how vLLM code reads a result) is the output; token prompts have
    no prompt text; cumulative_logprob is None without logprobs, as in vLLM."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    [out] = llm.generate([5, 6, 7], GREEDY)
    [choice] = out.outputs
    assert (choice.text, choice.token_ids, choice.finish_reason) == (out.text, out.token_ids, out.finish_reason)
    assert choice.cumulative_logprob is None and choice.logprobs is None
    assert out.prompt is None and out.prompt_token_ids == [5, 6, 7]


def test_logprobs_come_in_vllms_shape(make_llm: Callable[..., Any]) -> None:
    """`outputs[i].logprobs[t]` is vLLM's dict token id -> Logprob(logprob, rank, decoded_token):
    the sampled token first, with its rank among all tokens, then the top k with ranks 1..k, as
    vLLM scripts read them (`step[token_id].logprob`); the values are the engine's, the same as
    the top-level list."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    [out] = llm.generate([5, 6, 7], SamplingParams(max_tokens=5, temperature=1.5, seed=3, ignore_eos=True, logprobs=2))
    [choice] = out.outputs
    assert out.logprobs is not None and choice.logprobs is not None and len(choice.logprobs) == 5
    for step, token, engine_step in zip(choice.logprobs, choice.token_ids, out.logprobs):
        assert next(iter(step)) == token and step[token].logprob == engine_step.logprob
        top = [(t, lp.logprob) for t, lp in step.items() if t != token or lp.rank is not None and lp.rank <= 2]
        assert sorted(top, key=lambda pair: -pair[1]) == list(engine_step.top)
        assert sorted(lp.rank for t, lp in step.items() if t != token) == [r for r in (1, 2) if r != step[token].rank]
        assert step[token].rank == engine_step.rank
        assert all(lp.decoded_token == llm.get_tokenizer().decode([t]) for t, lp in step.items())
        assert len(step) == 3 - (step[token].rank <= 2)


CONVERSATION = [{"role": "user", "content": "w10"}]


def test_chat_takes_vllms_template_arguments(make_llm: Callable[..., Any]) -> None:
    """`add_generation_prompt`, `chat_template` and `tools` (vLLM's LLM.chat keywords) shape the
    prompt; before, each was a TypeError."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    with_prompt = llm.chat(CONVERSATION, GREEDY)[0].prompt_token_ids
    without = llm.chat(CONVERSATION, GREEDY, add_generation_prompt=False)[0].prompt_token_ids
    assert with_prompt == without + [5]  # the tiny template's generation prompt is "w5"
    custom = "{% for m in messages %}w7 {{ m['content'] }} {% endfor %}{% if tools %}w9{% endif %}"
    assert llm.chat(CONVERSATION, GREEDY, chat_template=custom)[0].prompt_token_ids[-2:] == [7, 10]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert llm.chat(CONVERSATION, GREEDY, chat_template=custom, tools=tools)[0].prompt_token_ids[-3:] == [7, 10, 9]
    with pytest.raises(InvalidParameter) as info:
        llm.chat(CONVERSATION, GREEDY, chat_template="{{ raise_exception('no') }}")
    assert info.value.param == "messages" and not llm.engine.has_unfinished()


@pytest.mark.parametrize("call,param", [
    (lambda llm: llm.generate(None, GREEDY), "prompt"),
    (lambda llm: llm.generate(5, GREEDY), "prompt"),
    (lambda llm: llm.generate(["w10"], {"max_tokens": 4}), "sampling_params"),
    (lambda llm: llm.generate(["w10"], [{"max_tokens": 4}]), "sampling_params"),
    (lambda llm: llm.chat({"role": "user", "content": "w10"}, GREEDY), "messages"),
    (lambda llm: llm.chat([{"role": "user", "content": "w10"}], GREEDY, chat_template_kwargs="x"),
     "chat_template_kwargs"),
    (lambda llm: llm.generate(["w10"], GREEDY, tenant=None), "tenant"),
    (lambda llm: llm.generate(["w10"], GREEDY, tenant=5), "tenant"),
    (lambda llm: llm.generate({"prompt_token_ids": "w5 w6"}, GREEDY), "prompt"),
    (lambda llm: llm.generate({"prompt": [5, 6]}, GREEDY), "prompt"),
    (lambda llm: llm.generate(["w10"], SamplingParams(structured="x")), "structured"),  # type: ignore[arg-type]
    (lambda llm: llm.generate(["w10"], SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"a": {1, 2}}))), "structured_outputs"),
])
def test_arguments_of_the_wrong_shape_are_invalid_parameters(make_llm: Callable[..., Any],
                                                             call: Callable[[Any], Any], param: str) -> None:
    """Not a TypeError, AttributeError or KeyError from deep inside the call."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    with pytest.raises(InvalidParameter) as info:
        call(llm)
    assert info.value.param == param and not llm.engine.has_unfinished()


def test_use_tqdm_is_taken_as_vllm_scripts_pass_it(make_llm: Callable[..., Any]) -> None:
    """`generate(..., use_tqdm=False)` is in most vLLM scripts; it changes nothing but display."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    expected = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids == expected
    assert llm.chat(CONVERSATION, GREEDY, use_tqdm=False)[0].finish_reason is not None
    with pytest.raises(InvalidParameter) as info:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm="no")
    assert info.value.param == "use_tqdm" and not llm.engine.has_unfinished()


def test_skip_special_tokens_false_puts_them_in_the_text(make_llm: Callable[..., Any]) -> None:
    """vLLM's skip_special_tokens (default true): false shows special tokens such as </s> in the
    text; the token ids are the same either way. EOS is forced with logit_bias and ignore_eos."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    eos = llm.get_tokenizer().eos_token_id
    forced = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={eos: 100.0})
    skipped, kept = (llm.generate([[5, 6, 7]], SamplingParams(**forced, skip_special_tokens=skip))[0]  # type: ignore[arg-type]
                     for skip in (True, False))
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == "" and kept.text.split() == ["</s>"] * 3
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(skip_special_tokens="no")  # type: ignore[arg-type]
    assert info.value.param == "skip_special_tokens"


def test_detokenize_false_returns_token_ids_only(make_llm: Callable[..., Any]) -> None:
    """vLLM's detokenize=False: the same tokens, no text (nothing decoded), logprobs without
    decoded tokens; stop strings, which are matched in the text, are refused."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    [text] = llm.generate([5, 6, 7], params)
    [ids] = llm.generate([5, 6, 7], dataclasses.replace(params, detokenize=False))
    assert ids.token_ids == text.token_ids and text.text != ""
    assert ids.text == "" and ids.outputs[0].text == ""
    assert ids.outputs[0].logprobs is not None and ids.prompt_logprobs is not None
    assert all(lp.decoded_token is None for step in ids.outputs[0].logprobs for lp in step.values())
    assert all(lp.decoded_token is None for step in ids.prompt_logprobs[1:] if step for lp in step.values())
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(detokenize=False, stop=["w5"])
    assert info.value.param == "detokenize"
    with pytest.raises(InvalidParameter):
        SamplingParams(detokenize="no")  # type: ignore[arg-type]


def test_tokenizer_replaces_the_models_own(make_llm: Callable[..., Any], llama_dir: Path, tmp_path: Path) -> None:
    """vLLM's `tokenizer=` / `--tokenizer`: a folder whose tokenizer (here the same vocabulary with
    another chat template) the engine, the served frontend (its ready message) and a PD frontend
    all use instead of the model's; one whose vocabulary the model cannot hold is refused."""
    from kvseal.disagg.serve import tokenizer_folder
    from kvseal.engine.process import _ready_msg

    folder = tmp_path / "tokenizer"
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}w9"
    tokenizer.save_pretrained(folder)
    llm = make_llm(tokenizer=str(folder))
    [out] = llm.chat([{"role": "user", "content": "w10 w11"}], SamplingParams(max_tokens=2, temperature=0))
    assert out.prompt_token_ids == [7, 10, 11, 8, 9]
    assert _ready_msg(llm.engine).tokenizer_path == str(folder)
    assert tokenizer_folder(str(llama_dir), str(folder)) == str(folder)
    assert _ready_msg(make_llm().engine).tokenizer_path == str(llama_dir)
    with pytest.raises(ConfigError, match="--tokenizer must be a local folder"):
        make_llm(tokenizer=str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="more than the model's vocabulary"):
        make_llm(model=str(make_char_model(tmp_path / "char")), tokenizer=str(folder), max_model_len=256)


def test_no_sampling_params_means_the_models_generation_config(make_llm: Callable[..., Any], llama_dir: Path,
                                                               tmp_path: Path) -> None:
    """vLLM's `LLM.generate(prompts)`: the model's generation_config.json sampling defaults
    (`get_default_sampling_params`), as `kvseal serve` applies them; `generation_config="vllm"`
    keeps the neutral ones."""
    import json
    import shutil

    folder = tmp_path / "with-defaults"
    shutil.copytree(llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.01, "top_k": 1, "top_p": 0.5}))
    llm = make_llm(model=str(folder))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.01, 1, 0.5)
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=16))[0].token_ids
    assert all(llm.generate([[5, 6, 7]])[0].token_ids == greedy for _ in range(3)), "top_k 1: the greedy answer"
    assert llm.chat(CONVERSATION)[0].finish_reason is not None
    neutral = make_llm(model=str(folder), generation_config="vllm").get_default_sampling_params()
    assert (neutral.temperature, neutral.top_k, neutral.top_p) == (1.0, -1, 1.0)
    with pytest.raises(ConfigError, match="generation"):
        make_llm(model=str(folder), generation_config="nope")


def test_generation_config_folder_and_override(make_llm: Callable[..., Any], llama_dir: Path,
                                               tmp_path: Path) -> None:
    """vLLM's `LLM(generation_config=FOLDER, override_generation_config={...})`: the folder's file in
    place of the model's, the override over it; a bad folder or override is refused before the
    model loads."""
    import json

    folder = tmp_path / "defaults"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 1, "max_new_tokens": 9}))
    llm = make_llm(generation_config=str(folder), override_generation_config={"max_new_tokens": 4, "top_p": 0.5})
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.3, 1, 0.5, 4)
    [out] = llm.generate([[5, 6, 7]])
    assert len(out.token_ids) <= 4, "the override's max_new_tokens, not the file's 9"
    neutral = make_llm(generation_config="vllm", override_generation_config={"temperature": 0.0})
    assert (neutral.get_default_sampling_params().temperature, neutral.get_default_sampling_params().top_k) == (0, -1)
    for bad, why in (({"generation_config": str(tmp_path)}, "holds no generation_config.json"),
                     ({"override_generation_config": {"max_tokens": 4}}, "unknown key.*max_tokens"),
                     ({"override_generation_config": {"temperature": -1.0}}, "temperature"),
                     ({"override_generation_config": '{"temperature": 0}'}, "must be a JSON object")):
        with pytest.raises(ConfigError, match=why):
            make_llm(**bad)


def test_no_sampling_params_means_the_models_max_new_tokens(make_llm: Callable[..., Any], llama_dir: Path,
                                                            tmp_path: Path) -> None:
    """vLLM's `LLM.get_default_sampling_params` takes generation_config.json's max_new_tokens as
    max_tokens; a prompt near the end of the context gets the rest of it (vLLM stops there), not
    a rejection; explicit params and `generation_config="vllm"` are untouched by it."""
    import json
    import shutil

    folder = tmp_path / "with-max-new-tokens"
    shutil.copytree(llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "temperature": 0.0}))
    llm = make_llm(model=str(folder), max_model_len=32)
    assert llm.get_default_sampling_params().max_tokens == 5
    [out] = llm.generate([[5, 6, 7]])
    assert (len(out.token_ids), out.finish_reason) == (5, "length")
    [chat] = llm.chat(CONVERSATION)
    assert len(chat.token_ids) <= 5
    [near_end] = llm.generate([list(range(5, 35))])
    assert len(near_end.token_ids) <= 2, "30 prompt tokens of 32: two are left"
    [own] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    assert len(own.token_ids) == 9
    neutral = make_llm(model=str(folder), generation_config="vllm", max_model_len=32)
    assert neutral.get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_vllms_call_shapes_are_taken(make_llm: Callable[..., Any], llama_dir: Path) -> None:
    """vLLM's positional order (prompts, sampling_params, use_tqdm, lora_request), lora_request=None,
    block_size for page_size and quantization=None; kvseal's tenant is keyword-only, and a LoRA
    adapter stays a named refusal."""
    from kvseal import LLM

    llm = LLM(str(llama_dir), kv_cache_tokens=64, max_model_len=64, dtype="float32", block_size=8, quantization=None)
    assert llm.engine.cache_config.page_size == 8
    expected = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert llm.generate([[5, 6, 7]], GREEDY, False, None)[0].token_ids == expected
    assert llm.generate([[5, 6, 7]], GREEDY, lora_request=None, tenant="alice")[0].token_ids == expected
    assert llm.chat(CONVERSATION, GREEDY, False, None)[0].finish_reason is not None
    for call in (lambda: llm.generate([[5, 6, 7]], GREEDY, lora_request=object()),
                 lambda: llm.chat(CONVERSATION, GREEDY, lora_request=object())):
        with pytest.raises(InvalidParameter) as info:
            call()
        assert info.value.param == "lora_request" and "LoRA" in info.value.message
    with pytest.raises(TypeError):
        llm.generate([[5, 6, 7]], GREEDY, True, None, "alice")  # type: ignore[misc]
    with pytest.raises(ConfigError, match="block_size"):
        make_llm(page_size=4, block_size=8)
