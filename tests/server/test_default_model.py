"""`kvseal serve` with no --model serves the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_process import ServerProcess, client_for

from kvseal.model_files import DEFAULT_MODEL_FILE


@pytest.mark.slow
def test_serves_the_default_model(tmp_path: Path) -> None:
    server = ServerProcess(None, tmp_path, extra_args=["--kv-cache-tokens", "4096", "--max-model-len", "2048",
                                                       "--dtype", "bfloat16"])
    server.start()
    try:
        client = client_for(server, "EMPTY")
        (model,) = client.models.list()
        assert model.id == server.model_name == Path(DEFAULT_MODEL_FILE).stem
        out = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Say hello."}],
                                             max_tokens=8, temperature=0)
        assert out.choices[0].message.content and out.usage is not None and out.usage.completion_tokens <= 8
    finally:
        assert server.terminate() == 0
