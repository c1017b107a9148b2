"""Processes that run no model keep torch out: the HTTP frontend, `kvseal bench`, `kvseal canary`.

torch costs a frontend hundreds of MB of resident memory and seconds of start-up for nothing:
the frontend only tokenizes. kvseal's own frontend modules never import it (an import-linter
contract and `tests/test_layering.py` hold that), but transformers imports torch whenever it is
installed, even for a tokenizer. `keep_torch_out()` marks torch as absent in this process
(`sys.modules["torch"] = None`, Python's documented way to block an import) so transformers
takes its torch-free path; an `import torch` afterwards raises ImportError at once instead of
loading it. Child processes (the engines, started with "spawn") are new interpreters and load
torch as usual.
"""

from __future__ import annotations

import sys


def keep_torch_out() -> bool:
    """Call first thing in a process that runs no model; True if torch is now kept out, False
    if it was loaded already (nothing to save then)."""
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True
