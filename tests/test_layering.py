"""The layering holds where it matters at run time: the processes that run no model load no torch.

The import contracts themselves are `[tool.importlinter]` in pyproject.toml, run by
`tools/check.sh` (`lint-imports`); this test checks what a user sees (resident memory).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

NO_MODEL = {
    "the HTTP app": "import kvseal.server.app, kvseal.server.main",
    "the colocated frontend's engine client": "import kvseal.engine.client",
    "kvseal canary": "import kvseal.canary.cli, kvseal.canary.runner",
    "kvseal bench": "import kvseal.bench.cli, kvseal.bench.serve, kvseal.bench.fairness",
    "the command line": "import kvseal.cli; kvseal.cli.build_parser()",
    # the engine process reserves its KV pool before it imports torch (kvseal.kvcache.reserve)
    "the engine process's entry and its pool reservation": "import kvseal.engine.process, kvseal.kvcache.reserve",
}


@pytest.mark.parametrize("what", sorted(NO_MODEL))
def test_importing_it_loads_no_torch(what: str) -> None:
    code = f"{NO_MODEL[what]}\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"{what} imports torch"


def _tokenize_in_a_process(setup: str) -> tuple[str, str]:
    """(the default tokenizer's ids of a mixed text, whether torch got loaded) in a new process."""
    code = (f"import sys\n{setup}\nfrom kvseal.bench.dataset import load_tokenizer\n"
            "print(load_tokenizer(None).encode('Hello <|im_start|>user\\n¿Qué tal? w100 w101'))\n"
            "print('torch' in sys.modules)")
    ids, torch_loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                                       check=True).stdout.strip().splitlines()
    return ids, torch_loaded


def test_a_process_that_tokenizes_without_torch_gives_the_same_tokens() -> None:
    """transformers' tokenizer without torch (what `kvseal serve`'s frontend and `kvseal bench` run)
    encodes as it does with torch, and torch stays importable for whoever needs it (xgrammar)."""
    without = _tokenize_in_a_process("from kvseal.no_torch import tokenize_without_torch\n"
                                     "assert tokenize_without_torch()")
    with_torch = _tokenize_in_a_process("import torch")
    assert without[0] == with_torch[0] and len(without[0]) > 10
    assert (without[1], with_torch[1]) == ("False", "True")
    importable = "from kvseal.no_torch import tokenize_without_torch\ntokenize_without_torch()\nimport torch"
    subprocess.run([sys.executable, "-c", importable], timeout=120, check=True)
