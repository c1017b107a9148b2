"""vLLM's flags and `LLM(...)` arguments that have no kvseal setting of their own.

Command lines and scripts brought over from vLLM carry options such as `--trust-remote-code`,
`--enforce-eager` or `--enable-chunked-prefill`. Each one listed here is either taken, where
kvseal already does what it asks or where it cannot apply (logged once at start-up, with why),
or refused by name, saying what kvseal does instead. None is ignored in silence, and none meets
argparse's bare "unrecognized arguments". Options that do have a kvseal meaning are flags of
their own (`--block-size`, `--enable-prefix-caching`, `--uvicorn-log-level`, ...).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvseal.errors import ConfigError

_NOTES_DEST = "vllm_notes"


def _any(value: Any) -> bool:
    return True


def _off(value: Any) -> bool:
    return value is False


def _not_off(value: Any) -> bool:
    return value is not False


def _words(*taken: str) -> Callable[[Any], bool]:
    return lambda value: str(value).strip().lower() in taken


def _number(taken: float) -> Callable[[Any], bool]:
    def takes(value: Any) -> bool:
        try:
            return float(value) == taken
        except (TypeError, ValueError):
            return False
    return takes


@dataclass(frozen=True)
class VllmOption:
    name: str  # the `LLM(...)` argument; the flag is --name with dashes
    why: str  # what kvseal does instead: said when the option is taken and when it is refused
    takes: Callable[[Any], bool] = _any  # the values taken; any other is refused
    is_switch: bool = False  # a flag without a value: True, or False from its --no- form / in `LLM(...)`
    negatable: bool = False  # a switch with a --no- form, as vLLM's
    short: str | None = None  # vLLM's short flag

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_AUDIT_LINES = ("kvseal writes one audit line per request whatever this says (its isolation contract, I8); "
                "--audit-log FILE sends them to a file rather than the log")
_LOCAL_ONLY = "kvseal loads models from local folders and .gguf files only and never downloads one"
VLLM_OPTIONS = (
    VllmOption("trust_remote_code", "kvseal runs no code from a model folder: the architectures it serves (Llama, "
               "Mistral, Qwen2, Qwen3) are built in", is_switch=True),
    VllmOption("enforce_eager", "kvseal captures no CUDA graphs: it always runs eagerly", is_switch=True),
    VllmOption("max_seq_len_to_capture", "kvseal captures no CUDA graphs"),
    VllmOption("enable_chunked_prefill", "kvseal always splits long prompts into chunks that share a step with "
               "decodes (--max-prefill-chunk-tokens sets their size)", _not_off, is_switch=True, negatable=True),
    VllmOption("disable_log_stats", "kvseal logs no periodic engine statistics; /metrics serves them",
               is_switch=True),
    VllmOption("enable_log_requests", _AUDIT_LINES, is_switch=True, negatable=True),
    VllmOption("disable_log_requests", _AUDIT_LINES, is_switch=True),
    VllmOption("disable_custom_all_reduce", "kvseal's tensor parallelism uses torch.distributed's all-reduce",
               is_switch=True),
    VllmOption("disable_fastapi_docs", "kvseal serves no /docs or /redoc pages", is_switch=True),
    VllmOption("swap_space", "kvseal recomputes a preempted request's KV rather than swapping it to host memory"),
    VllmOption("download_dir", _LOCAL_ONLY),
    VllmOption("revision", _LOCAL_ONLY),
    VllmOption("tokenizer_revision", _LOCAL_ONLY),
    VllmOption("load_format", "kvseal reads safetensors folders and .gguf files, whichever the model path is",
               _words("auto", "safetensors", "gguf")),
    VllmOption("kv_cache_dtype", "the KV cache is kept in --dtype", _words("auto")),
    VllmOption("tokenizer_mode", "kvseal uses the model's fast tokenizer (tokenizer.json, or the GGUF's)",
               _words("auto", "hf")),
    VllmOption("guided_decoding_backend", "kvseal's structured output is xgrammar's", _words("auto", "xgrammar")),
    VllmOption("scheduling_policy", "kvseal runs a tenant's requests first come, first served and shares each "
               "step's prefill fairly between tenants; requests have no priorities", _words("fcfs")),
    VllmOption("max_logprobs", "the most logprobs a position may ask for is fixed at 20 (OpenAI's limit)",
               _number(20)),
    VllmOption("response_role", "chat answers have the role 'assistant'", _words("assistant")),
    VllmOption("pipeline_parallel_size", "kvseal splits a model across devices with --tensor-parallel-size only",
               _number(1), short="-pp"),
    VllmOption("data_parallel_size", "one kvseal serves one replica: run one per replica behind a load balancer",
               _number(1), short="-dp"),
    VllmOption("cpu_offload_gb", "kvseal keeps every weight on the engine's device", _number(0)),
    VllmOption("enable_lora", "kvseal serves no LoRA adapters", _off, is_switch=True),
    VllmOption("speculative_config", "kvseal has no speculative decoding", lambda value: value is None),
)
_BY_NAME = {option.name: option for option in VLLM_OPTIONS}


def vllm_option_note(name: str, value: Any, shown: str | None = None) -> str:
    """The start-up line for vLLM's option `name` given `value` (written as `shown`; default: as
    its flag); ConfigError, saying why, for a value kvseal cannot honour."""
    option = _BY_NAME[name]
    if shown is None:
        shown = f"{option.flag} {value}" if not option.is_switch else \
            option.flag if value is not False else option.flag.replace("--", "--no-", 1)
    if not option.takes(value):
        raise ConfigError(f"vLLM's {shown} is not supported: {option.why}")
    return f"vLLM's {shown} is taken and changes nothing: {option.why}"


def vllm_argument_notes(arguments: dict[str, Any]) -> list[str]:
    """`LLM(...)`'s vLLM arguments among `arguments` (removed from it): their start-up lines, or
    ConfigError for the first one kvseal cannot honour."""
    return [vllm_option_note(name, value, f"{name}={value!r}")
            for name, value in [(name, arguments.pop(name)) for name in list(arguments) if name in _BY_NAME]]


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags, hidden from --help: a taken one adds its line to `vllm_notes(ns)`, a refused
    one stops parsing with the reason, as a bad value of any flag does."""
    for option in VLLM_OPTIONS:
        names = [option.flag, *([option.short] if option.short else [])]
        parser.add_argument(*names, dest=_NOTES_DEST, nargs=0 if option.is_switch else None,
                            action=_taker(option, True), default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if option.negatable:
            parser.add_argument(option.flag.replace("--", "--no-", 1), dest=_NOTES_DEST, nargs=0,
                                action=_taker(option, False), default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def vllm_notes(ns: argparse.Namespace) -> list[str]:
    return list(getattr(ns, _NOTES_DEST, []))


def _taker(option: VllmOption, switch_value: bool) -> type[argparse.Action]:
    class Take(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            try:
                note = vllm_option_note(option.name, switch_value if option.is_switch else values)
            except ConfigError as exc:
                parser.error(str(exc))
            setattr(ns, _NOTES_DEST, [*vllm_notes(ns), note])

    return Take
