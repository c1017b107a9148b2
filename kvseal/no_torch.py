"""Processes that run no model tokenize without torch: the HTTP frontend, `kvseal bench`, `kvseal canary`.

torch costs a frontend hundreds of MB of resident memory and seconds of start-up for nothing:
the frontend only tokenizes. kvseal's own frontend modules never import it (an import-linter
contract and `tests/test_layering.py` hold that), but transformers imports torch whenever it is
installed, even for a tokenizer. `tokenize_without_torch()` has transformers decide, once for
the process, that torch is absent (it asks while `sys.modules["torch"]` is None, Python's
documented way to block an import, and caches the answer), so its tokenizers take their
torch-free path. torch itself stays importable afterwards: xgrammar, which the front door uses
to check a structured-output request's JSON schema, loads it at the first such request. Child
processes (the engines, started with "spawn") are new interpreters and load torch as usual.
"""

from __future__ import annotations

import sys


def tokenize_without_torch() -> bool:
    """Call first thing in a process that runs no model, before anything imports transformers;
    True if transformers now runs without torch, False if torch was loaded already."""
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from transformers.utils import import_utils

        import_utils.is_torch_available()  # False now, and cached for the life of the process
    finally:
        del sys.modules["torch"]
    return True
