"""`kvseal serve --quantization int8`: one HTTP request, answered as the offline int8 engine does."""

from __future__ import annotations

from pathlib import Path

import openai
from server_process import ServerProcess, client_for

from kvseal.llm import LLM
from kvseal.types import SamplingParams

PROMPT = "w10 w11 w12 w13 w14"


def test_int8_server_answers_as_the_offline_int8_engine(server_model_dir: Path, tmp_path: Path) -> None:
    offline = LLM(str(server_model_dir), dtype="float32", quantization="int8", kv_cache_tokens=2048, page_size=4,
                  max_model_len=512)
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    server = ServerProcess(server_model_dir, tmp_path, keys={"key-q": {"tenant": "q"}},
                           extra_args=["--quantization", "int8"]).start()
    try:
        client: openai.OpenAI = client_for(server, "key-q")
        out = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected.text
        assert out.usage is not None and out.usage.completion_tokens == 12
        assert "quantization=int8: " in server.log()
    finally:
        assert server.terminate() == 0
