"""Non-streaming responses: wait for the request to end, then answer once: the body, or
503 `audit_unavailable` when the request's audit line could not be written (I8).

While waiting, a task watches the connection: if the client disconnects, the request is
aborted in the engine (its pages are freed) instead of running to the end for nobody.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvseal.messages.msgs import RequestOutputMsg
from kvseal.server import errors
from kvseal.server.call import Call
from kvseal.server.choices import ChoiceGroup
from kvseal.server.endpoint import Formatter
from kvseal.server.transcript import Transcript


async def respond_when_done(request: Request, call: Call, group: ChoiceGroup, fmt: Formatter) -> JSONResponse:
    watcher = asyncio.create_task(_abort_on_disconnect(request, call))
    transcripts = [Transcript() for _ in range(group.num_choices)]
    try:
        async for index, event in group.events():
            err = errors.for_event(event)
            if err is not None:
                return errors.response(err, call.request_id, call.rate_headers())
            assert isinstance(event, RequestOutputMsg)
            transcripts[index].add(event)
        if call.is_withheld:  # no success without its audit line (I8)
            return errors.response(errors.audit_unavailable(call.state.audit), call.request_id, call.rate_headers())
        return JSONResponse(fmt.response(transcripts), headers=call.response_headers())
    finally:
        watcher.cancel()
        call.abort_on_exit()
        call.http_done()


async def _abort_on_disconnect(request: Request, call: Call) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    call.abort_on_exit()
