"""Starting engine processes (`spawn_context`) and restarting those that die: the policy (`--engine-restart-limit`,
`--engine-restart-backoff-s`) and its bookkeeping, shared by colocated `kvseal serve` (one engine
child, `kvseal.engine.client`) and `kvseal serve --pd` (its spawned engines, `kvseal.disagg.serve`).

An engine that exits while the server is not shutting down is reaped at once (no `<defunct>`
child), its requests fail with an error (never a 200), and it is started again after a delay:
`backoff_s` for the first restart in a row, doubling for each further one, at most
`MAX_BACKOFF_S`. A restarted engine that stays up `STABLE_AFTER_S` ends the row. After `limit`
restarts in a row the engine stays down (logged at CRITICAL) and the server answers 503 until it
is restarted; `limit` 0 never restarts. Meanwhile the server answers 503 `engine_unavailable`
naming the exit and when the restart comes. A colocated engine silent for `--engine-timeout-s`
(hung: stopped, frozen) is killed by the frontend (`kvseal.engine.client`) and then handled here
as any other exit.
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import time
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.context import SpawnContext

from kvseal.engine_api import RESTART_THE_SERVER
from kvseal.errors import ConfigError
from kvseal.flags import flag

MAX_BACKOFF_S = 60.0
STABLE_AFTER_S = 60.0  # up this long after a restart: the next exit starts a new row
MIN_ENGINE_TIMEOUT_S = 2.0  # four heartbeats (`kvseal.engine.process.HEARTBEAT_S`)


@dataclass(frozen=True)
class RestartPolicy:
    """`kvseal serve`'s engine supervision flags (colocated and `--pd`)."""

    engine_restart_limit: int = field(default=5, metadata=flag(
        "restart an engine process that died (colocated, or one `serve --pd` started) at most this many times in "
        "a row (a restart that stays up 60 s ends the row); 0 never restarts: the server answers 503 until it is "
        "restarted itself"))
    engine_restart_backoff_s: float = field(default=1.0, metadata=flag(
        "seconds before the first restart in a row; each further one waits twice as long, at most 60 s"))
    engine_timeout_s: float = field(default=60.0, metadata=flag(
        "a colocated engine process that sends nothing, not even its heartbeat (every 0.5 s, from a thread of its "
        "own), for this many seconds is hung (stopped, frozen): it is killed and restarted as one that crashed"))

    def __post_init__(self) -> None:
        if isinstance(self.engine_restart_limit, bool) or self.engine_restart_limit < 0:
            raise ConfigError(f"--engine-restart-limit must be an integer >= 0, got {self.engine_restart_limit!r}")
        if not 0 <= self.engine_restart_backoff_s < math.inf:
            raise ConfigError(f"--engine-restart-backoff-s must be a number of seconds >= 0, got "
                              f"{self.engine_restart_backoff_s!r}")
        if isinstance(self.engine_timeout_s, bool) or not MIN_ENGINE_TIMEOUT_S <= self.engine_timeout_s < math.inf:
            raise ConfigError(f"--engine-timeout-s must be a number of seconds >= {MIN_ENGINE_TIMEOUT_S:g} (the "
                              f"engine's heartbeat comes every 0.5 s), got {self.engine_timeout_s!r}")

    def delay_s(self, num_in_a_row: int) -> float:
        """The wait before restart number `num_in_a_row` (1 for the first) of a row."""
        return min(MAX_BACKOFF_S, self.engine_restart_backoff_s * 2.0 ** (num_in_a_row - 1))


def describe_exit(exitcode: int | None) -> str:
    """A process's end in words: 'exit code 1', 'killed by SIGKILL (signal 9)'."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-exitcode})"
    return f"exit code {exitcode}"


@dataclass
class RestartTracker:
    """One engine's restarts: when the next one may come, and whether the limit is reached."""

    policy: RestartPolicy
    num_in_a_row: int = 0
    num_restarts: int = 0  # since the server started
    _started_s: float = field(default_factory=time.monotonic)

    def started(self) -> None:
        """The engine process was (re)started now."""
        self._started_s = time.monotonic()

    def next_delay_s(self) -> float | None:
        """The engine exited: seconds until it is restarted, or None when it must stay down."""
        if time.monotonic() - self._started_s >= STABLE_AFTER_S:
            self.num_in_a_row = 0
        if self.num_in_a_row >= self.policy.engine_restart_limit:
            return None
        self.num_in_a_row += 1
        self.num_restarts += 1
        return self.policy.delay_s(self.num_in_a_row)

    def gave_up(self) -> str:
        """Why the engine stays down (once `next_delay_s` said None): what clients and the log say."""
        if not self.policy.engine_restart_limit:
            return f"not restarted (--engine-restart-limit 0): {RESTART_THE_SERVER}"
        times = "time" if self.num_in_a_row == 1 else "times"
        return (f"restarted {self.num_in_a_row} {times} in a row (--engine-restart-limit "
                f"{self.policy.engine_restart_limit}); not restarted again: {RESTART_THE_SERVER}")


def restarted(why: str) -> str:
    """What clients are told of an engine started again after `why`, until it answers."""
    return f"{why}; restarted at {time.strftime('%H:%M:%S', time.gmtime())} UTC, waiting for it to answer"


def spawn_context() -> SpawnContext:
    """multiprocessing's "spawn", its resource tracker started first, immune to SIGHUP.

    The tracker is a child of the server in its process group, and SIGHUP to that group is the
    documented way to reload the keys: with SIGHUP's default action it died and stayed <defunct>
    (then spawn started a new one). It starts with SIGHUP blocked (a signal mask survives fork and
    exec; the tracker unblocks only SIGINT and SIGTERM), and is started again, the same way, by the
    next spawn if it ever dies. The mask is per thread, so this is safe off the main thread, and a
    SIGHUP sent to the server meanwhile is delivered once it is unblocked, never lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return multiprocessing.get_context("spawn")
