"""Structured output on the real default model (SmolLM2-135M-Instruct): the official client's
`parse` returns an object that validates against its schema."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from pydantic import BaseModel
from server_process import ServerProcess


class City(BaseModel):
    name: str
    country: str
    population_millions: float


@pytest.mark.slow
def test_parse_with_a_pydantic_model_on_the_default_model(tmp_path: Path) -> None:
    server = ServerProcess(None, tmp_path, extra_args=["--kv-cache-tokens", "4096", "--max-model-len", "2048",
                                                       "--dtype", "float32"])
    server.start()
    try:
        # a long timeout: 135M parameters in float32 on a shared CPU can take a second per token
        client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=900)
        completion = client.chat.completions.parse(
            model=server.model_name, response_format=City, max_tokens=100, temperature=0,
            messages=[{"role": "user", "content": "Describe Paris as JSON with name, country and population."}])
        city = completion.choices[0].message.parsed
        assert isinstance(city, City) and city.name
        tokenized = client.post("/../tokenize", body={"prompt": "Paris"}, cast_to=object)
        assert tokenized["count"] >= 1  # type: ignore[index]
    finally:
        assert server.terminate() == 0
