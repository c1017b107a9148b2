"""`kvseal bench`: an OpenAI-API serving benchmark that reports what `vllm bench serve` reports.

One concept per file: `dataset` (random token-id prompts), `client` (one streamed request),
`runner` (concurrency / request-rate loop with a progress bar), `memory` (server RSS and KV
pool sampling), `metrics` (vLLM's metric definitions and key names), `fairness` (two tenants),
`plot` (throughput and p99 TTFT against concurrency), `cli` (the argument definitions).
"""
