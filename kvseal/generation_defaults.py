"""The sampling defaults a request gets for the fields it omits (vLLM's `--generation-config`),
served (`kvseal serve`) and offline (`LLM.get_default_sampling_params`) alike.

`auto` (the default, as in vLLM): the model's `generation_config.json` values for
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens`, where it has
them; OpenAI's neutral values for the rest. `vllm`: the neutral values only (temperature 1, top_p 1,
top_k and min_p off, repetition_penalty 1, no output cap), whatever the model ships. The resolved
values are logged at start-up; a malformed file stops start-up.

`max_new_tokens` is transformers' name for `max_tokens`, and as in vLLM (its
`ModelConfig.get_diff_sampling_param` renames it, `entrypoints/utils.get_max_tokens` applies it)
it is only a default: a request that sets its own `max_tokens` keeps it, even a larger one; one
that omits it gets `max_new_tokens`, capped by the rest of the context window.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvseal.errors import ConfigError, InvalidParameter
from kvseal.types import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "vllm")


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = None  # the file's max_new_tokens; None: the rest of the context
    source: str = "neutral"  # where the values came from, for the start-up log

    @classmethod
    def load(cls, mode: str, model_dir: Path | None) -> GenerationDefaults:
        """Resolve `mode` against the model folder (None: no folder, e.g. a bare .gguf file)."""
        if mode not in GENERATION_CONFIG_MODES:
            raise ConfigError(f"--generation-config must be one of {GENERATION_CONFIG_MODES}, got {mode!r}")
        path = model_dir / "generation_config.json" if model_dir is not None else None
        if mode == "vllm" or path is None or not path.is_file():
            return cls(source="neutral (--generation-config vllm)" if mode == "vllm" else "neutral (no file)")
        return cls.from_file(path)

    @classmethod
    def from_file(cls, path: Path) -> GenerationDefaults:
        try:
            raw: Any = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        values = {f.name: raw[_file_key(f.name)] for f in fields(cls)
                  if f.name != "source" and raw.get(_file_key(f.name)) is not None}
        try:
            defaults = cls(**_typed(values), source=str(path)).normalized()
            defaults.sampling_params()
        except (ValueError, InvalidParameter) as exc:
            raise ConfigError(f"{path}: bad sampling default: {exc}") from exc
        return defaults

    def normalized(self) -> GenerationDefaults:
        """transformers' top_k=0 means "off", which is -1 here."""
        return dataclasses.replace(self, top_k=self.top_k if self.top_k > 0 else -1)

    def sampling_params(self) -> SamplingParams:
        """These defaults as the params of a request that sets nothing else (vLLM's
        `LLM.get_default_sampling_params`): with no `max_new_tokens`, `SamplingParams`' own
        max_tokens (16, vLLM's), as vLLM's `SamplingParams.from_optional` leaves it."""
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                repetition_penalty=self.repetition_penalty, min_p=self.min_p)
        return params if self.max_tokens is None else dataclasses.replace(params, max_tokens=self.max_tokens)

    def describe(self) -> str:
        return (f"temperature={self.temperature:g} top_p={self.top_p:g} top_k={self.top_k} min_p={self.min_p:g} "
                f"repetition_penalty={self.repetition_penalty:g} "
                f"max_tokens={'(rest of the context)' if self.max_tokens is None else self.max_tokens} "
                f"(from {self.source})")


def _file_key(name: str) -> str:
    """The generation_config.json key of a field: transformers calls max_tokens max_new_tokens."""
    return "max_new_tokens" if name == "max_tokens" else name


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = {}
    for name, value in values.items():
        if name == "max_tokens":  # a token count: a float (even 100.0) is a mistake, not a rounding
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"max_new_tokens must be a positive integer, got {value!r}")
            typed[name] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}")
        typed[name] = int(value) if name == "top_k" else float(value)
    return typed
