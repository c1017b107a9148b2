"""The sampling defaults a request gets for the fields it omits (vLLM's `--generation-config`),
served (`kvseal serve`) and offline (`LLM.get_default_sampling_params`) alike.

`auto` (the default, as in vLLM): the model's `generation_config.json` values for
`temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`, where it has them; OpenAI's
neutral values for the rest. `vllm`: the neutral values only (temperature 1, top_p 1, top_k
and min_p off, repetition_penalty 1), whatever the model ships. The resolved values are logged at
start-up; a malformed file stops start-up.
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
        values = {f.name: raw[f.name] for f in fields(cls) if f.name != "source" and raw.get(f.name) is not None}
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
        `LLM.get_default_sampling_params`)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              repetition_penalty=self.repetition_penalty, min_p=self.min_p)

    def describe(self) -> str:
        return (f"temperature={self.temperature:g} top_p={self.top_p:g} top_k={self.top_k} min_p={self.min_p:g} "
                f"repetition_penalty={self.repetition_penalty:g} (from {self.source})")


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}")
        typed[name] = int(value) if name == "top_k" else float(value)
    return typed
