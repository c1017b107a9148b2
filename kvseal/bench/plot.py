"""`kvseal bench plot`: output throughput and p99 TTFT against concurrency, one line per server.

Reads result JSONs of `kvseal bench serve` (or `vllm bench serve`, same keys); a result's
server is its `label` (set with --label; default its base URL), and its x value its
`max_concurrency`. Several results at one (label, concurrency) are drawn as their mean, with
every repetition shown as a dot.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvseal.errors import KvsealError

PANELS = (("output_throughput", "output throughput (tok/s)"), ("p99_ttft_ms", "p99 TTFT (ms)"))


def load_result(path: Path) -> dict[str, Any]:
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KvsealError(f"cannot read benchmark result {path}: {exc}") from exc
    if not isinstance(result, dict):
        raise KvsealError(f"{path} is not a benchmark result (a JSON object); give result JSONs written by "
                          f"`kvseal bench serve --result-json` or `vllm bench serve`")
    missing = [k for k in ("max_concurrency", *(key for key, _ in PANELS)) if result.get(k) is None]
    if missing:
        raise KvsealError(f"{path} has no {', '.join(missing)}: plot needs results of runs with --concurrency")
    return result


def group_points(results: Sequence[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """label -> concurrency -> the results at that point."""
    groups: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        groups[str(r.get("label") or r.get("base_url") or "server")][int(r["max_concurrency"])].append(r)
    return groups


def plot_results(paths: Sequence[Path], out: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not paths:
        raise KvsealError("plot needs at least one result JSON")
    groups = group_points([load_result(p) for p in paths])
    concurrencies = sorted({c for points in groups.values() for c in points})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4.2))
    for ax, (key, ylabel) in zip(axes, PANELS):
        for label, points in sorted(groups.items()):
            _draw(ax, label, points, key)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies], minor=False)
        ax.set_xticks([], minor=True)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "kvseal bench serve")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _draw(ax: Any, label: str, points: dict[int, list[dict[str, Any]]], key: str) -> None:
    xs = sorted(points)
    means = [sum(r[key] for r in points[x]) / len(points[x]) for x in xs]
    (line,) = ax.plot(xs, means, marker="o", label=label)
    for x in xs:
        ax.scatter([x] * len(points[x]), [r[key] for r in points[x]], color=line.get_color(), s=10, alpha=0.5)
