"""Per-engine /metrics series live while their engine instance is up: an engine that goes down,
or comes back as a new instance, takes its old series with it; `kvseal_pd_engine_up` stays."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

import kvseal
from kvseal.disagg.frontend import EngineLink
from kvseal.disagg.metrics import PdMetrics
from kvseal.disagg.msgs import PdStatsMsg
from kvseal.messages.msgs import EngineStatsMsg


def stats(instance_id: str) -> PdStatsMsg:
    return PdStatsMsg(instance_id, "decode", EngineStatsMsg(1, 0, 7, 9, 0), 16, 2, 3, 4096, 0.5,
                      {"transfer_failed": 1}, 0, {"not_curve": 2, "unlisted_key": 1}, 0)


def series_of(registry: CollectorRegistry, instance_id: str) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if f'engine="{instance_id}"' in line]


def test_a_down_or_restarted_engines_series_are_removed() -> None:
    registry = CollectorRegistry()
    metrics = PdMetrics(registry)
    link = EngineLink("decode", "127.0.0.1:9002", b"key", socket=None, monitor=None)  # type: ignore[arg-type]  # unused
    link.is_up, link.stats = True, stats("decode-aaaa")
    metrics.record(link)
    assert len(series_of(registry, "decode-aaaa")) == 10  # six gauges, three refusal reasons, one failure reason
    link.is_up, link.stats = False, None  # what PdClient._engine_down does
    metrics.record(link)
    assert series_of(registry, "decode-aaaa") == []
    text = generate_latest(registry).decode()
    assert 'kvseal_pd_engine_up{address="127.0.0.1:9002",role="decode"} 0.0' in text
    link.is_up, link.stats = True, stats("decode-bbbb")
    metrics.record(link)
    link.stats = stats("decode-cccc")  # restarted as a new instance before it was seen down
    metrics.record(link)
    assert series_of(registry, "decode-bbbb") == [] and len(series_of(registry, "decode-cccc")) == 10


def test_the_documented_handoff_failure_reasons_are_the_codes() -> None:
    """docs/OPERATIONS.md lists every reason the engines count in `kvseal_pd_handoff_failures`,
    and no other: the reasons are read from the source (what is counted, refused, returned as a
    refusal), the documented ones from the table."""
    documented = re.findall(r"^\| `([a-z_]+)` \| (?:decode|prefill) \|", OPERATIONS.read_text(), re.MULTILINE)
    assert len(documented) == len(set(documented))
    assert set(documented) == counted_reasons()


OPERATIONS = Path(__file__).parents[2] / "docs" / "OPERATIONS.md"
PACKAGE = Path(kvseal.__file__).parent
# Where the disagg code names a reason: a key of a failure or refusal counter, a verification
# `Refusal`, the code prefill refuses a transfer with, what a receiver's check returns.
COUNTERS = ("failures", "refusals")
CHECKS = ("deliver", "_check", "_import")


def counted_reasons() -> set[str]:
    constants = string_constants()
    reasons: set[str] = set()
    for path in sorted((PACKAGE / "disagg").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            for expr in reason_expressions(node):
                reasons |= strings_of(expr, constants)
    return reasons


def reason_expressions(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr in COUNTERS:
        return [node.slice]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Refusal":
        return node.args[:1]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_refuse":
        return node.args[1:2]
    if isinstance(node, ast.FunctionDef) and node.name in CHECKS:
        return [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["why"]:
        return [node.value]
    return []


def strings_of(expr: ast.expr, constants: dict[str, str]) -> set[str]:
    """The reason strings `expr` can be: a literal, a module constant, either branch of an `if`."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return {expr.value}
    if isinstance(expr, ast.Name) and expr.id in constants:
        return {constants[expr.id]}
    if isinstance(expr, ast.IfExp):
        return strings_of(expr.body, constants) | strings_of(expr.orelse, constants)
    return set()  # computed (prefill's admission code, a call's result): named where it is made


def string_constants() -> dict[str, str]:
    """Every module-level `NAME = "text"` of the package."""
    constants = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper():
                constants[node.targets[0].id] = node.value.value
    return constants
