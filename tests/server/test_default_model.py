"""`kvseal serve` with no --model serves the default model (SmolLM2-135M-Instruct): it answers a
chat request, and the official client's `parse` returns an object that validates against its
schema (greedy, in float32: in bfloat16 this prompt runs past 100 tokens). One server for both: the
real model is the suite's costliest start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel
from server_process import ServerProcess

from kvseal.model_files import DEFAULT_MODEL_FILE

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str
    country: str
    population_millions: float


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(None, tmp_path_factory.mktemp("default-model"),
                           extra_args=["--kv-cache-tokens", "4096", "--max-model-len", "2048", "--dtype", "float32"])
    server.start()
    yield server
    assert server.terminate() == 0


def _client(server: ServerProcess) -> openai.OpenAI:
    # a long timeout: 135M parameters on a shared CPU can take a second per token
    return openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=900)


def test_serves_the_default_model(default_server: ServerProcess) -> None:
    client = _client(default_server)
    (model,) = client.models.list()
    assert model.id == default_server.model_name == Path(DEFAULT_MODEL_FILE).stem
    out = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Say hello."}],
                                         max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.usage is not None and out.usage.completion_tokens <= 8


def test_parse_with_a_pydantic_model_on_the_default_model(default_server: ServerProcess) -> None:
    client = _client(default_server)
    completion = client.chat.completions.parse(
        model=default_server.model_name, response_format=City, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON with name, country and population."}])
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    tokenized = client.post("/../tokenize", body={"prompt": "Paris"}, cast_to=object)
    assert tokenized["count"] >= 1  # type: ignore[index]
