"""Command-line flags generated from config dataclass fields: name, type, default and help in one place.

A field that is a flag carries `metadata=flag(help, ...)`; `add_flags(parser, Config)` adds one
argparse argument per such field (dest = the field's name, default = the field's default), and
`values_of(ns, Config)` reads them back as keyword arguments for `Config(...)`. So a flag is
defined once, where its value lives, and every command that takes it (`serve`, `engine`,
`generate`, `plan`) gets the same name, type, default and help; `LLM(...)` takes the field names.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

_KEY = "kvseal.flag"


@dataclass(frozen=True)
class Flag:
    help: str
    name: str | None = None  # default: --field-name; a name without dashes is a positional argument
    type: Callable[[str], Any] | None = None  # default: the default value's type (str when None)
    choices: Sequence[str] | None = None
    metavar: str | None = None
    # switches: "store_true", "store_false" or argparse.BooleanOptionalAction
    action: str | builtins.type[argparse.Action] | None = None
    aliases: tuple[str, ...] = ()  # other names, as good as `name` (vLLM's, say)
    deprecated: tuple[str, ...] = ()  # old names that still work and warn


def flag(help: str, **kwargs: Any) -> dict[str, Flag]:
    """`field(metadata=flag(...))`: this field is a command-line flag."""
    return {_KEY: Flag(help, **kwargs)}


def flag_fields(config: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(config) if _KEY in f.metadata]


def flag_name(field: dataclasses.Field[Any]) -> str:
    meta: Flag = field.metadata[_KEY]
    return meta.name or "--" + field.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config: type,
              only: Collection[str] | None = None, skip: Collection[str] = ()) -> None:
    """One argument per flag field of `config` (or of those named in `only`), minus `skip`."""
    for field in flag_fields(config):
        if (only is None or field.name in only) and field.name not in skip:
            _add(parser, field)


def values_of(ns: argparse.Namespace, config: type) -> dict[str, Any]:
    """The flag fields of `config` that `ns` holds, as keyword arguments for `config(...)`."""
    return {f.name: getattr(ns, f.name) for f in flag_fields(config) if hasattr(ns, f.name)}


def _add(parser: argparse.ArgumentParser | argparse._ArgumentGroup, field: dataclasses.Field[Any]) -> None:
    meta: Flag = field.metadata[_KEY]
    default = field.default if field.default is not dataclasses.MISSING else None
    name = flag_name(field)
    kwargs: dict[str, Any] = {"default": default, "help": meta.help}
    if name.startswith("-"):
        kwargs.update(dest=field.name, required=field.default is dataclasses.MISSING)
    if meta.action is not None:
        kwargs["action"] = meta.action
    else:
        kwargs["type"] = meta.type or (type(default) if default is not None else str)
        kwargs.update({k: v for k, v in (("choices", meta.choices), ("metavar", meta.metavar)) if v is not None})
    parser.add_argument(name, *meta.aliases, **kwargs)
    for old in meta.deprecated:
        parser.add_argument(old, dest=field.name, type=kwargs.get("type", str), default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS, action=_deprecated(old, flag_name(field)))


def _deprecated(old: str, new: str) -> type[argparse.Action]:
    class DeprecatedName(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            print(f"kvseal: warning: {old} is deprecated; use {new} (same meaning)", file=sys.stderr)
            setattr(ns, self.dest, values)

    return DeprecatedName
