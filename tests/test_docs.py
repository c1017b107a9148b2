"""The documents name what is in the tree: docs/SECURITY.md's invariant table promises that every
file, function and test it names exists, and docs/ARCHITECTURE.md draws the import contract."""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECURITY = ROOT / "docs" / "SECURITY.md"
SOURCE_SUFFIXES = (".py", ".c", ".h", ".md", ".toml", ".sh")


@cache
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@cache
def _sources(folder: str) -> tuple[Path, ...]:
    return tuple(p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".c", ".h"))


def _defines(path: Path, name: str) -> bool:
    """`name` is a function, class, field or constant of `path` (Python), or a function of C."""
    word = re.escape(name)
    if path.suffix in (".c", ".h"):
        return re.search(rf"\b{word}\s*\(", _text(path)) is not None
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{word}\b|^\s*(?:self\.)?{word}\s*[:=]", _text(path),
                     re.MULTILINE) is not None


def _resolve(name: str, last: Path | None) -> Path | None:
    """A path as the table writes it: from the root, under kvseal/ or tests/, or beside the
    row's previous one (`test_b.py` after `tests/disagg/test_a.py`)."""
    for base in (ROOT, ROOT / "kvseal", ROOT / "tests", *([last.parent] if last is not None else [])):
        if (base / name).exists():
            return base / name
    return None


def _check_token(token: str, last: Path | None, chained: bool) -> tuple[str | None, Path | None]:
    """(what is missing, or None; the path that follows names refer to)."""
    path_part, _, test = token.partition("::")
    if path_part.endswith(SOURCE_SUFFIXES) or token.startswith("::"):
        path = _resolve(path_part, last) if path_part else last
        if path is None:
            return f"`{token}`: no such file", last
        name = test.split("[")[0]
        if name and not _defines(path, name):
            return f"`{token}`: {path.relative_to(ROOT)} has no {name}", path
        return None, path
    bare = token.removesuffix("()")
    if re.fullmatch(r"test_\w+(\[[^\]]*\])?", bare):
        name = bare.split("[")[0]
        if not any(_defines(p, name) for p in _sources("tests")):
            return f"`{token}`: no test of that name under tests/", last
        return None, last
    if re.fullmatch(r"[A-Z]\w*\.\w+", bare):  # Class.member
        cls, member = bare.split(".")
        homes = [p for p in _sources("kvseal") if _defines(p, cls)]
        if not any(_defines(p, member) for p in homes):
            return f"`{token}`: no class {cls} with {member} under kvseal/", last
        return None, last
    if re.fullmatch(r"[A-Z][a-z]\w*", bare):  # a class
        if not any(_defines(p, bare) for p in _sources("kvseal")):
            return f"`{token}`: no class {bare} under kvseal/", last
        return None, last
    if re.fullmatch(r"_?[a-z]\w*", bare):
        # a function named after a source file of kvseal/ is that file's; any other name (a field,
        # an error code, a metric) only has to be in the tree
        if chained and last is not None and last.suffix in (".py", ".c") and ROOT / "kvseal" in last.parents:
            return (None if _defines(last, bare) else f"`{token}`: {last.relative_to(ROOT)} has no {bare}"), last
        if not any(re.search(rf"\b{re.escape(bare)}\b", _text(p)) for p in _sources("kvseal") + _sources("tests")):
            return f"`{token}`: not in kvseal/ or tests/", last
    return None, last


def security_table_problems(text: str) -> list[str]:
    problems = []
    for line in text.splitlines():
        if not re.match(r"\| I\d+ \|", line):
            continue
        row, last = line.split(" | ")[0].strip("| "), None
        for cell in line.split(" | ")[2:]:
            chained = False  # a name directly after a path (or after such a name) is that path's
            for between, token in re.findall(r"([^`]*)`([^`]+)`", cell):
                chained = chained and not re.search(r"[(;]|\bfrom\b|\bby\b|\band\b", between)
                problem, new_last = _check_token(token, last, chained)
                if problem is not None:
                    problems.append(f"{row}: {problem}")
                is_path = token.partition("::")[0].endswith(SOURCE_SUFFIXES) and "::" not in token
                chained = is_path or (chained and new_last == last)
                last = new_last
    return problems


def test_every_file_function_and_test_the_security_table_names_exists() -> None:
    """SECURITY.md: "Every file, function and test named in a row is in this tree."."""
    assert security_table_problems(_text(SECURITY)) == []


def test_the_table_check_catches_a_name_that_is_gone() -> None:
    row = ("| I9 | x | `kvseal/kvcache/records.py` `_check_pages` | `tests/kvcache/test_prefix_cache.py` "
           "(`test_no_such_test`), `tests/server/test_prefix_cache_api.py::test_the_ownership_check_refuses_a_cached_"
           "page_of_another_namespace` | `WriteRecords._check_pages`, `tests/no/such_file.py` |")
    assert len(security_table_problems(row)) == 5, security_table_problems(row)


def _layers_contract() -> list[set[str]]:
    config = tomllib.loads(_text(ROOT / "pyproject.toml"))
    [contract] = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [{name.strip().removeprefix("kvseal.") for name in layer.split("|")} for layer in contract["layers"]]


def _diagram(text: str) -> list[set[str]]:
    """The rows of ARCHITECTURE.md's layer diagram (the block after "Layers (`[tool.importlinter]`"),
    each row's modules before its comment (two spaces or more)."""
    block = re.search(r"^Layers \(`\[tool\.importlinter\]`.*?```\n(.*?)```", text, re.DOTALL | re.MULTILINE)
    assert block is not None, "ARCHITECTURE.md has no layer diagram"
    return [{name.strip() for name in re.split(r"\s{2,}", line.strip())[0].split("|")}
            for line in block.group(1).splitlines() if line.strip()]


def test_the_architecture_diagram_draws_the_layers_contract() -> None:
    """pyproject.toml: "docs/ARCHITECTURE.md draws the same map": the same rows, top to bottom,
    module for module; and every top-level module of kvseal has its place in it."""
    layers = _layers_contract()
    assert _diagram(_text(ROOT / "docs" / "ARCHITECTURE.md")) == layers
    modules = {p.stem for p in (ROOT / "kvseal").glob("*.py")} | \
        {p.parent.name for p in (ROOT / "kvseal").glob("*/__init__.py")}
    assert modules - {"__init__"} - set().union(*layers) == set()


def _engine_flag_table() -> list[str]:
    text = _text(ROOT / "README.md")
    start = text.index("| flag / `LLM(...)` argument |")
    return [line for line in text[start:].split("\n\n")[0].splitlines()[2:] if line.startswith("|")]


def readme_flag_table_problems(rows: list[str]) -> list[str]:
    """Each flag of the README's engine table whose `LLM(...)` name is not the flag with `_` for
    `-` and is not written in its row as `name=`."""
    import argparse
    import dataclasses

    from kvseal.cli import build_parser
    from kvseal.config import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs) if f.init}
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    actions = {option: action for action in commands.choices["serve"]._actions for option in action.option_strings}
    problems = []
    for row in rows:
        cell = row.split(" | ")[0]
        for option in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", cell):  # -tp: --tensor-parallel-size's alias
            action = actions.get(option)
            if action is None or action.dest not in fields:
                problems.append(f"{option}: not an engine flag of kvseal serve")
            elif action.dest != option.removeprefix("--").replace("-", "_") \
                    and action.dest not in re.findall(r"`(\w+)=", cell) and option != "--block-size":
                problems.append(f"{option}: LLM(...) takes {action.dest}=, the row does not say so")
    return problems


def test_the_readme_flag_table_says_each_llm_argument_that_is_not_the_flags_name() -> None:
    """README: `LLM(...)` takes the flag with `_` for `-`, "except where the table says otherwise"
    (vLLM's --block-size is --page-size's other spelling, in its row)."""
    assert readme_flag_table_problems(_engine_flag_table()) == []
    assert readme_flag_table_problems(["| `--tp-timeout 60` | x |", "| `--no-prefix-caching` | x |"]) == [
        "--tp-timeout: LLM(...) takes tp_timeout_s=, the row does not say so",
        "--no-prefix-caching: LLM(...) takes enable_prefix_caching=, the row does not say so"]
