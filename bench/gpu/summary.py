"""One screen of what the GPU run found, from the JSON files the helpers wrote under $OUT:
printed and written to summary.json."""

from __future__ import annotations

import json
from typing import Any

from common import out_dir, write_json


def _load(name: str) -> Any:
    path = out_dir() / name
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    parity, throughput, canary = _load("parity.json"), _load("throughput.json"), _load("canary.json")
    rows: list[dict[str, Any]] = []
    for shape in (throughput or {}).get("shapes", []):
        for row in shape["rows"]:
            rows.append({"shape": shape["shape"], "concurrency": row["concurrency"],
                         "kvseal_tok_s": round(row["kvseal"]["output_tokens_per_s"], 1),
                         "transformers_tok_s": round(row["transformers"]["output_tokens_per_s"], 1),
                         "speedup": round(row["speedup_vs_transformers"], 2),
                         "decode_step_ms": row["kvseal"]["decode_step_ms_median"],
                         "roofline_step_ms": round(row["roofline_step_ms"], 3),
                         "step_over_roofline": row["step_over_roofline"]})
    write_json("summary.json", {
        "parity_all_equal": None if parity is None else parity["all_equal"],
        "parity": None if parity is None else {r["model"]: r["all_equal"] for r in parity["results"]},
        "canary_passed": None if canary is None else canary["passed"],
        "copy_bandwidth_gb_s": None if throughput is None else round(throughput["copy_bandwidth_gb_s"], 1),
        "throughput": rows,
    })


if __name__ == "__main__":
    main()
