"""Summarize a compare.sh output folder as Markdown, one section per load generator (client):
per server and concurrency, the range over
repetitions of output throughput, mean / p99 TTFT, TPOT and peak server RSS; kvseal's median
output throughput and p99 TTFT as ratios to vllm-best's, and the ratio of each repetition's pair
(the same prompts, run back to back when compare.sh ran with INTERLEAVE=1); the CPU a resident
server used while idle; kvseal's KV pool against `kvseal plan`.

Result files are `<server>__<client>-c<C>-r<R>.json`; older sittings' `<server>-c<C>-r<R>.json`
were all made by kvseal's client.

Usage: python bench/peers/summarize.py OUT_DIR [--baseline SERVER]   (default vllm-best)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

BASELINE = "vllm-best"
CLIENT_NOTES = {"kvseal": "`kvseal bench serve`, token-id prompts",
                "vllm": "`vllm bench serve`, random dataset sent as text"}


Runs = dict[str, dict[int, list[dict[str, Any]]]]  # server -> concurrency -> results


def load(out: Path) -> dict[str, Runs]:
    """client -> its runs."""
    clients: dict[str, Runs] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for path in sorted(out.glob("*-c*-r*.json")):
        r = json.loads(path.read_text())
        head, rep = path.stem.rsplit("-r", 1)
        r["repetition"] = int(rep)
        server, _, client = head.rsplit("-c", 1)[0].partition("__")
        clients[client or "kvseal"][server][int(r["max_concurrency"])].append(r)
    return clients


def span(values: list[float], fmt: str = "{:.1f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"


def table(runs: Runs) -> list[str]:
    lines = ["| server | concurrency | runs | output tok/s | TTFT mean / p99 (ms) | TPOT mean (ms) | peak RSS (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, points in sorted(runs.items()):
        for c, rs in sorted(points.items()):
            rss = [r["peak_rss_bytes"] / 2**20 for r in rs if r.get("peak_rss_bytes")]
            lines.append(f"| {label} | {c} | {len(rs)} | {span([r['output_throughput'] for r in rs])} | "
                         f"{span([r['mean_ttft_ms'] for r in rs], '{:.0f}')} / "
                         f"{span([r['p99_ttft_ms'] for r in rs], '{:.0f}')} | "
                         f"{span([r['mean_tpot_ms'] for r in rs])} | {span(rss, '{:.0f}') if rss else 'n/a'} |")
    return lines


def ratios(runs: Runs, baseline: str = BASELINE) -> list[str]:
    """Each kvseal configuration (labels starting with "kvseal") against the baseline."""
    if baseline not in runs:
        return []
    lines: list[str] = []
    for label in sorted(name for name in runs if name.startswith("kvseal")):
        lines += ["", f"| concurrency | {label} / {baseline} output tok/s (medians) | p99 TTFT {label} / {baseline} "
                      "| per repetition: output tok/s, p99 TTFT |",
                  "|---:|---:|---:|---|"]
        for c in sorted(set(runs[label]) & set(runs[baseline])):
            ours, theirs = runs[label][c], runs[baseline][c]
            tput = statistics.median(r["output_throughput"] for r in ours) / statistics.median(
                r["output_throughput"] for r in theirs)
            ttft = statistics.median(r["p99_ttft_ms"] for r in ours) / statistics.median(
                r["p99_ttft_ms"] for r in theirs)
            by_rep = {r["repetition"]: r for r in theirs}
            pairs = [(a["output_throughput"] / b["output_throughput"], a["p99_ttft_ms"] / b["p99_ttft_ms"])
                     for a in sorted(ours, key=lambda r: r["repetition"])
                     if (b := by_rep.get(a["repetition"])) is not None]
            per_rep = ", ".join(f"{t:.2f}x / {p:.2f}x" for t, p in pairs)
            lines.append(f"| {c} | {tput:.2f}x | {ttft:.2f}x | {per_rep} |")
    return lines


def idle_cpu(out: Path) -> list[str]:
    """compare.sh INTERLEAVE=1: CPU seconds each resident server used while the others ran."""
    path = out / "idle_cpu.tsv"
    if not path.exists():
        return []
    rows = [line.split("\t") for line in path.read_text().splitlines()[1:] if line.strip()]
    return ["", "CPU used by a resident server while another one ran: " + "; ".join(
        f"{name} {float(cpu):.1f} s over {wall} s" for name, cpu, wall in rows) + "."]


def pool_check(out: Path, runs: Runs) -> list[str]:
    plan = out / "kvseal_plan.txt"
    kvseal_runs = [r for points in runs.get("kvseal", {}).values() for r in points]  # runs: kvseal's client
    pools = {r["kv_pages_total"] for r in kvseal_runs if r.get("kv_pages_total")}
    match = re.search(r"^pool\s+([\d,]+) pages", plan.read_text(), re.MULTILINE) if plan.exists() else None
    if not match or not pools:
        return ["", "KV pool vs plan: not available (no kvseal_plan.txt or no kvseal /metrics)"]
    planned = int(match.group(1).replace(",", ""))
    verdict = "matches" if pools == {planned} else "DIFFERS from"
    return ["", f"KV pool: the server reported {', '.join(map(str, sorted(pools)))} pages; "
                f"`kvseal plan` says {planned} pages: {verdict} the plan."]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a compare.sh output folder")
    parser.add_argument("--baseline", default=BASELINE, help="the server the ratios are against")
    ns = parser.parse_args()
    out: Path = ns.out
    clients = load(out)
    lines: list[str] = []
    for client, runs in sorted(clients.items()):
        heading = f"### {client}'s client ({CLIENT_NOTES.get(client, client)})"
        lines += [heading, "", *table(runs), *ratios(runs, ns.baseline), ""]
    print("\n".join(lines + idle_cpu(out) + pool_check(out, clients.get("kvseal", {}))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
