"""Which of kvseal's runtime and test dependencies this Python cannot import: their names as pip
installs them, one line (for `pip install --no-index --find-links bench/gpu/wheels`)."""

from __future__ import annotations

import importlib.util

# pip name -> import name (torch and triton are the machine's own)
NEEDED = {"transformers": "transformers", "safetensors": "safetensors", "gguf": "gguf", "tokenizers": "tokenizers",
          "jinja2": "jinja2", "sentencepiece": "sentencepiece", "fastapi": "fastapi", "uvicorn": "uvicorn",
          "uvloop": "uvloop", "httptools": "httptools", "pydantic": "pydantic", "pyzmq": "zmq", "msgspec": "msgspec",
          "prometheus-client": "prometheus_client", "tqdm": "tqdm", "numpy": "numpy", "httpx": "httpx",
          "aiohttp": "aiohttp", "xgrammar": "xgrammar", "cffi": "cffi", "pytest": "pytest",
          "pytest-timeout": "pytest_timeout", "hypothesis": "hypothesis"}

print(" ".join(name for name, module in NEEDED.items() if importlib.util.find_spec(module) is None))
