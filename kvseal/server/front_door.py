"""I1 at the front door: every context-length check the frontend makes goes through here.

The frontend refuses a request that cannot fit before the engine hears of it (the engine's
re-check is defense in depth, not the guard). One place, so the test-only fault
`SKIP_FRONT_DOOR_ADMISSION` can switch the whole front door off and show that the tests
notice (the engine's re-check then refuses instead, which the audit log tells apart).
"""

from __future__ import annotations

from kvseal._testing.faults import Fault, is_active
from kvseal.admission import AdmissionLimits, admit, check_context_length
from kvseal.types import SamplingParams


def is_checking() -> bool:
    return not is_active(Fault.SKIP_FRONT_DOOR_ADMISSION)


def check_context(num_prompt_tokens: int, max_tokens: int, limits: AdmissionLimits) -> None:
    """`check_context_length` (raises `ContextLengthExceeded`), at the front door."""
    if is_checking():
        check_context_length(num_prompt_tokens, max_tokens, limits)


def admit_at_the_door(prompt_token_ids: list[int], params: SamplingParams, limits: AdmissionLimits) -> list[int]:
    """`admit`, at the front door: the prompt ids to send to the engine."""
    return admit(prompt_token_ids, params, limits) if is_checking() else prompt_token_ids
