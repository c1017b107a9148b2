"""Test-only launcher: run the `kvseal` command line with fault switches on.

    python tests/fault_launcher.py FAULT[,FAULT...] -- serve --model ... (any kvseal arguments)

The faults are switched on at import time, from this script's own argv, so that processes
started with multiprocessing's "spawn" (the engine process re-imports this script as its
`__mp_main__`, with the same argv) have them on too. This file lives under tests/ and is
never installed: no production flag, environment variable or config field reaches it.
"""

from __future__ import annotations

import sys

from kvseal._testing.faults import Fault, inject


def _split_argv(argv: list[str]) -> tuple[list[Fault], list[str]]:
    if "--" not in argv or argv.index("--") != 1:
        raise SystemExit("usage: fault_launcher.py FAULT[,FAULT...] -- KVSEAL-ARGS...")
    names = [n for n in argv[0].split(",") if n and n != "none"]
    return [Fault(n) for n in names], argv[2:]


_FAULTS, _KVSEAL_ARGV = _split_argv(sys.argv[1:])
# On for the life of this process (and of its spawned children). The context managers are
# kept: a dropped one is garbage-collected at once, and closing it switches its fault off.
_INJECTED = [inject(fault) for fault in _FAULTS]
for _injected in _INJECTED:
    _injected.__enter__()


if __name__ == "__main__":
    from kvseal.cli import main

    sys.exit(main(_KVSEAL_ARGV))
