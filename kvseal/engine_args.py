"""The engine's command-line flags (`EngineArgs`' flag fields) and their `EngineArgs`.

Kept apart from `kvseal.cli` so the server's tests build engine arguments without the CLI.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection

from kvseal.config import EngineArgs
from kvseal.errors import ConfigError
from kvseal.flags import add_flags, values_of

_MODEL_POSITIONAL = "model_positional"


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_positional: bool = False,
                         skip: Collection[str] = ()) -> None:
    """Every `EngineArgs` flag (less `skip`); `model_positional` also takes the model as the first
    positional argument, as `vllm serve MODEL` does (`--model` still works)."""
    if model_positional:
        parser.add_argument(_MODEL_POSITIONAL, nargs="?", default=None, metavar="MODEL",
                            help="the model (as --model); a local folder or .gguf file")
    add_flags(parser, EngineArgs, skip=skip)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = values_of(ns, EngineArgs)
    positional = getattr(ns, _MODEL_POSITIONAL, None)
    if positional is not None:
        if values.get("model") not in (None, positional):
            raise ConfigError(f"the model is given twice: {positional} and --model {values['model']}; give one")
        values["model"] = positional
    return EngineArgs(**values)
