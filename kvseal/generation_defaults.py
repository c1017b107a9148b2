"""The sampling defaults a request gets for the fields it omits (vLLM's `--generation-config` and
`--override-generation-config`), served (`kvseal serve`, colocated or `--pd`) and offline
(`LLM.get_default_sampling_params`) alike.

Where the values come from (vLLM's `ModelConfig.get_diff_sampling_param`):

- `auto` (the default, as in vLLM): the model folder's `generation_config.json`, where it has one;
- a folder: the `generation_config.json` in that folder instead of the model's;
- `vllm`: no file, the neutral values only (temperature 1, top_p 1, top_k and min_p off,
  repetition_penalty 1, no output cap), whatever the model ships.

The keys read are vLLM's: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
`max_new_tokens`. The override (a JSON object) is laid over the file's values, or over the neutral
ones under `vllm`; a key it sets to null drops the file's value for that key, as in vLLM (whose
`config.update(override)` leaves a None there, and None values are not taken). Every field left
unset by both is neutral. The resolved values, each with where it came from, are logged at
start-up.

What is refused, at start-up, where vLLM would go on in silence:

- a folder that does not exist or holds no `generation_config.json`. vLLM falls back there
  (`try_get_generation_config` tries the folder's `config.json`, then returns None: neutral
  defaults), so a mistyped path serves neutral sampling with nothing said; an operator who names
  a folder means its file to be used, so kvseal stops and says which path it could not read;
- an override key vLLM does not read (vLLM drops it), `max_tokens` among them: vLLM's override
  takes transformers' `max_new_tokens` only, and a `max_tokens` there would be silently lost;
- a malformed file or override value, checked the same way for both (`_validated`).

`max_new_tokens` is transformers' name for `max_tokens`, and as in vLLM (its
`ModelConfig.get_diff_sampling_param` renames it, `entrypoints/utils.get_max_tokens` applies it)
it is only a default: a request that sets its own `max_tokens` keeps it, even a larger one; one
that omits it gets `max_new_tokens`, capped by the rest of the context window.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvseal.errors import ConfigError, InvalidParameter
from kvseal.types import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder holding FILE_NAME
FILE_NAME = "generation_config.json"
# vLLM's `get_diff_sampling_param` keys, by their generation_config.json (transformers) names
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
OVERRIDE_FLAG = "--override-generation-config"


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = None  # max_new_tokens; None: the rest of the context
    source: str = "no file"  # the file read, or why none was: for the start-up log
    # (SAMPLING_KEYS key, "file" or "override") for each value not neutral: for the start-up log
    origins: tuple[tuple[str, str], ...] = ()

    @classmethod
    def load(cls, mode: str, model_dir: Path | None,
             override: Mapping[str, Any] | None = None) -> GenerationDefaults:
        """Resolve `mode` ("auto", "vllm" or a folder) against the model folder (None: no folder,
        e.g. a bare .gguf file), with `override` (vLLM's `override_generation_config`) laid over
        the file's values. A bad folder, file or override raises ConfigError naming it."""
        path = _file_of(mode, model_dir)
        file_values = _read_sampling_values(path) if path is not None else {}
        override_values = checked_override(override if override is not None else {})
        merged = {key: value for key, value in (file_values | override_values).items() if value is not None}
        where = f"{path} with {OVERRIDE_FLAG}" if path is not None else OVERRIDE_FLAG
        origins = tuple((key, "override" if key in override_values else "file") for key in SAMPLING_KEYS
                        if key in merged)
        return dataclasses.replace(_validated(merged, where), source=_source(mode, path), origins=origins)

    @classmethod
    def check(cls, mode: str, override: Mapping[str, Any] | None) -> None:
        """All that can be checked before the model folder is known (the mode, a named folder's
        file, the override), so that a bad value stops start-up before the weights load."""
        cls.load(mode, None, override)

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
        """Each value with where it came from: [file], [override] or [neutral]."""
        origin = dict(self.origins)
        max_tokens = "(rest of the context)" if self.max_tokens is None else str(self.max_tokens)
        shown = (("temperature", f"{self.temperature:g}"), ("top_p", f"{self.top_p:g}"), ("top_k", str(self.top_k)),
                 ("min_p", f"{self.min_p:g}"), ("repetition_penalty", f"{self.repetition_penalty:g}"),
                 ("max_new_tokens", max_tokens))
        values = " ".join(f"{_field_of(key)}={text} [{origin.get(key, 'neutral')}]" for key, text in shown)
        return f"{values} ({self.source})"


def parse_override(text: str | None) -> dict[str, Any]:
    """`--override-generation-config`'s JSON text as a checked override (None: no override)."""
    if text is None:
        return {}
    try:
        raw: Any = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{OVERRIDE_FLAG} is not valid JSON ({exc}): give an object such as "
                          f"'{{\"temperature\": 0.7}}'") from exc
    return checked_override(raw)


def checked_override(override: object) -> dict[str, Any]:
    """An override as vLLM takes it (an object of SAMPLING_KEYS, null dropping the file's value),
    its values checked as a file's are; ConfigError names the first thing wrong."""
    if not isinstance(override, Mapping):
        raise ConfigError(f"{OVERRIDE_FLAG} must be a JSON object such as '{{\"temperature\": 0.7}}', "
                          f"got {type(override).__name__} {override!r}")
    unknown = [key for key in override if key not in SAMPLING_KEYS]
    if unknown:
        hint = ("; max_tokens is max_new_tokens there, as in vLLM, which reads no max_tokens key"
                if "max_tokens" in unknown else "")
        raise ConfigError(f"{OVERRIDE_FLAG}: unknown key(s) {', '.join(map(repr, unknown))}: it takes "
                          f"{', '.join(SAMPLING_KEYS)}{hint}")
    values = dict(override)
    _validated({key: value for key, value in values.items() if value is not None}, OVERRIDE_FLAG)
    return values


def _file_of(mode: str, model_dir: Path | None) -> Path | None:
    """The generation_config.json `mode` reads, if any. `auto` without one in the model folder is
    neutral, as in vLLM; a folder named without one is refused (the module's docstring says why)."""
    if mode == "vllm":
        return None
    if mode == "auto":
        path = model_dir / FILE_NAME if model_dir is not None else None
        return path if path is not None and path.is_file() else None
    takes = f"--generation-config takes auto, vllm or a folder holding {FILE_NAME}"
    if not mode.strip():
        raise ConfigError(f"{takes}, got {mode!r}")
    folder = Path(mode)
    if not folder.is_dir():
        raise ConfigError(f"{takes}; {mode!r} is no folder (a path that does not exist, or a file: give the "
                          f"folder that holds {FILE_NAME})")
    path = folder / FILE_NAME
    if not path.is_file():
        raise ConfigError(f"{takes}; the folder {mode!r} holds no {FILE_NAME}, so its sampling defaults cannot be "
                          f"read: add the file, or pass auto for the model's own")
    return path


def _source(mode: str, path: Path | None) -> str:
    if path is not None:
        return f"file {path}"
    return "no file: --generation-config vllm" if mode == "vllm" else f"no {FILE_NAME} in the model folder"


def _read_sampling_values(path: Path) -> dict[str, Any]:
    """The file's SAMPLING_KEYS values that are set (transformers writes null for unset ones),
    checked; the file's other keys (token ids, do_sample, ...) are not sampling defaults."""
    try:
        raw: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    values = {key: raw[key] for key in SAMPLING_KEYS if raw.get(key) is not None}
    _validated(values, str(path))
    return values


def _validated(values: Mapping[str, Any], where: str) -> GenerationDefaults:
    """The one check of sampling-default values, a file's and an override's alike: `_typed`'s
    types, then `SamplingParams`' own ranges. ConfigError names `where` and the key."""
    try:
        defaults = GenerationDefaults(**_typed(values)).normalized()
        defaults.sampling_params()
    except (ValueError, InvalidParameter) as exc:
        raise ConfigError(f"{where}: bad sampling default: {exc}") from exc
    return defaults


def _field_of(key: str) -> str:
    """The field a generation_config.json key fills: transformers' max_new_tokens is max_tokens."""
    return "max_tokens" if key == "max_new_tokens" else key


def _typed(values: Mapping[str, Any]) -> dict[str, Any]:
    """SAMPLING_KEYS values as GenerationDefaults' fields, or ValueError naming the key."""
    typed: dict[str, Any] = {}
    for key, value in values.items():
        if key == "max_new_tokens":  # a token count: a float (even 100.0) is a mistake, not a rounding
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"max_new_tokens must be a positive integer, got {value!r}")
            typed["max_tokens"] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value!r}")
        if key == "top_k" and value != int(value):  # a count of tokens: 2.5 is a mistake, not 2
            raise ValueError(f"top_k must be a whole number, got {value!r}")
        typed[key] = int(value) if key == "top_k" else float(value)
    return typed
