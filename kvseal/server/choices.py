"""`n` choices of each prompt: one engine request per choice, one request for the call.

Each choice is its own engine request (id `<request id>-<k>` for the call's choice k, the
request id itself when the call has one choice), so each choice computes its prompt's KV
itself, except the full pages it finds already published in the tenant's prefix cache when it
is scheduled. A completions request may send several prompts: choice k is choice k % n of
prompt k // n, as OpenAI orders them. Choice i of a seeded prompt uses seed + i, so the
request is reproducible and its choices differ.

The group observes every choice's handle and is the call's single view of them: it forwards
progress, and reports one terminal event when the last choice has ended. A failure wins over
a success, and of several failures the first to arrive: the one the response ended with (the
others follow from it, the choices still running being aborted once it ended the response),
but a tripped isolation check whenever it arrives (the breach is audited and counted as one).
Output tokens and KV pages are summed for the audit record (I8), and so are the prompts'
tokens, each prompt counted once; the call's latency metrics follow choice 0. For a request
that fails without an output of its own (the engine lost, an engine's refusal),
`progress()` sums the choices' latest outputs the same way, so what they generated is counted
however many choices there are.
`events()` yields every choice's outputs, tagged with the choice index, in arrival order, up
to the last terminal one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from kvseal.engine_api import RequestEvent, RequestObserver, is_terminal, isolation_failure
from kvseal.messages.msgs import AddRequestMsg, RequestOutputMsg, SamplingParamsMsg
from kvseal.types import choice_seed

ChoiceEvent = tuple[int, RequestEvent]


def choice_msgs(msgs: list[AddRequestMsg]) -> list[AddRequestMsg]:
    """The engine requests for the choices of each prompt's `msgs` (one request each, all under
    the call's request id), in the call's choice order (just the message when there is one)."""
    n = msgs[0].params.n
    if n == 1 and len(msgs) == 1:
        return msgs
    return [msgspec.structs.replace(msg, request_id=f"{msg.request_id}-{p * n + i}", params=_choice_params(msg, i))
            for p, msg in enumerate(msgs) for i in range(n)]


def _choice_params(msg: AddRequestMsg, index: int) -> SamplingParamsMsg:
    return msgspec.structs.replace(msg.params, n=1, seed=choice_seed(msg.params.seed, index))


class ChoiceGroup:
    def __init__(self, request_id: str, num_prompt_tokens: list[int], observer: RequestObserver,
                 choices_per_prompt: int | None = None) -> None:
        """`num_prompt_tokens`: per choice, its prompt's (one entry per choice)."""
        self.request_id = request_id
        self.num_choices = len(num_prompt_tokens)
        self._per_prompt = choices_per_prompt or self.num_choices
        self.num_prompt_tokens = num_prompt_tokens
        self._observer = observer
        self._queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self._terminal: dict[int, RequestEvent] = {}
        # the first choice end that is no success; a tripped isolation check outranks any other
        self._first_failure: RequestEvent | None = None
        self._latest: dict[int, RequestOutputMsg] = {}  # each choice's latest output (totals so far)

    def observer_for(self, index: int) -> RequestObserver:
        return _ChoiceObserver(self, index)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events, up to and including the last choice's terminal one."""
        num_ended = 0
        while num_ended < self.num_choices:
            index, event = await self._queue.get()
            num_ended += is_terminal(event)
            yield index, event

    @property
    def has_failed(self) -> bool:
        """A choice ended in failure: the response ends with it, whatever the other choices do."""
        return self._first_failure is not None

    def progress(self) -> RequestOutputMsg | None:
        """Every choice's latest output, summed as the final ones are: what the call has
        generated so far (None before any output). It is no finished output (no finish reason)."""
        if not self._latest:
            return None
        latest = [self._latest.get(i) for i in range(self.num_choices)]
        per_prompt = [latest[start:start + self._per_prompt] for start in range(0, self.num_choices, self._per_prompt)]
        firsts = [next(o for o in choices if o is not None) for choices in per_prompt if any(choices)]
        summed = self._summed([o for o in latest if o is not None], list(self._latest.values())[-1], firsts)
        # every prompt was submitted, whichever of its choices has output yet
        return msgspec.structs.replace(summed, num_prompt_tokens=sum(self.num_prompt_tokens[::self._per_prompt]),
                                       finished=False, finish_reason=None, stop_reason=None)

    def max_num_output_tokens(self) -> int:
        """The most tokens one choice has generated so far."""
        return max((o.num_output_tokens for o in self._latest.values()), default=0)

    def _on_output(self, index: int, out: RequestOutputMsg) -> None:
        self._latest[index] = out
        if index == 0:  # the call's latency metrics follow one stream, not n interleaved ones
            self._observer.on_output(out)
        if not out.finished:
            self._queue.put_nowait((index, out))

    def _on_terminal(self, index: int, event: RequestEvent) -> None:
        self._terminal[index] = event
        if _is_failure(event) and (self._first_failure is None or _outranks(event, self._first_failure)):
            self._first_failure = event
        if isinstance(event, RequestOutputMsg):
            self._latest[index] = event
        self._queue.put_nowait((index, event))
        if len(self._terminal) == self.num_choices:
            self._observer.on_terminal(self._merged())

    def _merged(self) -> RequestEvent:
        events = [self._terminal[i] for i in range(self.num_choices)]
        if self.num_choices == 1:
            return events[0]
        failed = self._first_failure
        outputs = [e for e in events if isinstance(e, RequestOutputMsg)]
        if failed is not None and not isinstance(failed, RequestOutputMsg):
            return failed
        last = failed if failed is not None else outputs[-1]
        return self._summed(outputs, last, [e for e in events[::self._per_prompt] if isinstance(e, RequestOutputMsg)])

    def _summed(self, outputs: list[RequestOutputMsg], last: RequestOutputMsg,
                firsts: list[RequestOutputMsg]) -> RequestOutputMsg:
        """`last` with the call's totals: output tokens and KV pages of every choice in `outputs`,
        prompt tokens of each prompt's first choice (`firsts`: one per prompt); its phases are the
        first choice's in `outputs` (the call's latencies follow choice 0)."""
        return msgspec.structs.replace(
            last, request_id=self.request_id, timing=outputs[0].timing,
            num_output_tokens=sum(o.num_output_tokens for o in outputs),
            num_pages_reserved=sum(o.num_pages_reserved for o in outputs),
            num_kv_tokens_written=sum(o.num_kv_tokens_written for o in outputs),
            num_prompt_tokens=sum(o.num_prompt_tokens for o in firsts),
            num_cached_tokens=sum(o.num_cached_tokens for o in firsts))


def _is_failure(event: RequestEvent) -> bool:
    """A choice's end that is no success: the response answers it with an error (`errors.for_event`)."""
    return not isinstance(event, RequestOutputMsg) or event.finish_reason == "abort"


def _outranks(event: RequestEvent, first: RequestEvent) -> bool:
    """A tripped isolation check is the request's end whenever it arrives: after another
    choice's refusal it must still be audited, counted and logged as the breach it is."""
    return isolation_failure(event) is not None and isolation_failure(first) is None


class _ChoiceObserver:
    def __init__(self, group: ChoiceGroup, index: int) -> None:
        self._group = group
        self._index = index

    def on_output(self, out: RequestOutputMsg) -> None:
        self._group._on_output(self._index, out)

    def on_terminal(self, event: RequestEvent) -> None:
        self._group._on_terminal(self._index, event)
