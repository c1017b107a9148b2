"""The shared worker lane (`fair_lane.FairLane`) at shutdown: closing it ends the wait of every
caller, the one whose job runs and those still queued, rather than leaving them waiting."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvseal.server.fair_lane import FairLane


def test_closing_the_lane_cancels_the_running_and_the_queued_jobs_callers() -> None:
    async def scenario() -> None:
        lane = FairLane("kvseal-test-lane")
        started, release = threading.Event(), threading.Event()

        def held() -> str:
            started.set()
            release.wait(30)
            return "held"

        running = asyncio.ensure_future(lane.run("alice", held))
        queued = asyncio.ensure_future(lane.run("bob", lambda: "bob's"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        lane.close()
        done, _ = await asyncio.wait({running, queued}, timeout=30)
        release.set()
        assert done == {running, queued}, "a caller still waits on a closed lane"
        for caller in (running, queued):
            with pytest.raises(asyncio.CancelledError):
                caller.result()

    asyncio.run(scenario())
