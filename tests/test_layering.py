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
}


@pytest.mark.parametrize("what", sorted(NO_MODEL))
def test_importing_it_loads_no_torch(what: str) -> None:
    code = f"{NO_MODEL[what]}\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"{what} imports torch"


def test_a_process_that_keeps_torch_out_still_tokenizes(tmp_path: object) -> None:
    """transformers' tokenizer without torch (what `kvseal serve`'s frontend and `kvseal bench` run)."""
    code = ("from kvseal.no_torch import keep_torch_out\nassert keep_torch_out()\n"
            "from kvseal.bench.dataset import load_tokenizer\n"
            "tokenizer = load_tokenizer(None)\nprint(tokenizer.encode('hello world'))\n"
            "import sys\nprint(sys.modules['torch'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    ids, torch_module = out.stdout.strip().splitlines()
    assert ids.startswith("[") and len(ids) > 2 and torch_module == "None"
