"""vLLM's per-request histograms on real requests: a server (its app in this process, its engine a
process of its own over IPC, no port) serves completions on a tiny random model, and /metrics
shows each ended request's phases, as its engine measured them, and its sizes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from kvseal.canary.evidence import MetricsSnapshot, _parse
from kvseal.config import EngineArgs
from kvseal.engine.client import EngineClient
from kvseal.server.app import build_app
from kvseal.server.audit import AuditLog
from kvseal.server.auth import ApiKeyTable
from kvseal.server.config import ServerConfig
from kvseal.server.metrics import ServerMetrics
from kvseal.server.prompts import PromptEncoder
from kvseal.server.state import AppState

PHASES = ("queue", "prefill", "decode", "inference")


def served_metrics(model_dir: Path, tmp_path: Path, bodies: list[dict[str, Any]]) -> MetricsSnapshot:
    """Serve `bodies` (completions, one after the other) and read /metrics after the last."""
    return asyncio.run(_serve(model_dir, tmp_path, bodies))


async def _serve(model_dir: Path, tmp_path: Path, bodies: list[dict[str, Any]]) -> MetricsSnapshot:
    args = EngineArgs(model=str(model_dir), dtype="float32", kv_cache_tokens=256, page_size=4, max_model_len=64,
                      max_num_batched_tokens=64)
    metrics = ServerMetrics()
    engine = EngineClient(args, "WARNING")
    engine.on_stats = metrics.record_stats
    try:
        info = await asyncio.wait_for(engine.start(), timeout=120)
        state = AppState(ServerConfig(), engine, info, PromptEncoder.load(info.tokenizer_path), ApiKeyTable(),
                         metrics, AuditLog(str(tmp_path / "audit.jsonl"), include_prompts=False))
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvseal.test", timeout=60) as client:
            for body in bodies:
                response = await client.post("/v1/completions", json={"model": state.model_name, **body})
                assert response.status_code == 200, response.text
            text = (await client.get("/metrics")).text
        state.audit.close()
        return MetricsSnapshot(_parse(text))
    finally:
        await engine.shutdown(timeout_s=30)


def test_every_ended_request_has_its_phases_and_sizes(server_model_dir: Path, tmp_path: Path) -> None:
    snap = served_metrics(server_model_dir, tmp_path, [
        {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
        {"prompt": [8, 9, 10, 11, 12], "max_tokens": 3, "n": 2, "ignore_eos": True},
    ])
    assert [snap.total(f"vllm:request_{phase}_time_seconds_count") for phase in PHASES] == [2, 2, 2, 2]
    queue_s, prefill_s, decode_s, inference_s = (snap.total(f"vllm:request_{p}_time_seconds_sum") for p in PHASES)
    assert min(queue_s, prefill_s, decode_s) >= 0 and decode_s > 0, "each decoded more than one token"
    assert abs(inference_s - (prefill_s + decode_s)) <= 1e-9 * max(1.0, inference_s)
    e2e_s = snap.total("vllm:e2e_request_latency_seconds_sum")
    assert queue_s + inference_s <= e2e_s, "the engine's phases lie inside the frontend's arrival-to-end"
    assert snap.total("vllm:request_prompt_tokens_sum") == 3 + 5  # the n=2 call's prompt counts once, as usage
    assert snap.total("vllm:request_generation_tokens_sum") == 4 + 2 * 3
    assert snap.total("vllm:request_max_num_generation_tokens_sum") == 4 + 3
    assert snap.total("vllm:request_params_n_sum") == 1 + 2 and snap.total("vllm:request_params_n_count") == 2
    assert snap.total("vllm:request_params_max_tokens_sum") == 4 + 3
