"""One tenant's grammar cannot stall another's structured output (colocated `kvseal serve`).

Grammar compiles run in worker processes under `--grammar-compile-timeout-s`, served
round-robin by tenant; a client that leaves cancels its compile; tool definitions pass the
same door checks as response_format. The PD twin of the scenario is in
tests/disagg/test_pd_structured.py. Every check also runs on a server with the fault that
breaks what it guards switched on, and must fail there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from grammar_scenario import (
    OVER_LIMIT_SCHEMAS,
    GrammarServer,
    check_b_not_behind_a,
    check_disconnect_cancels_the_compile,
    check_tool_count_is_bounded,
    check_tools_refused_like_response_format,
    check_tools_total_is_bounded,
)

BREAKING_FAULTS = ["shared_grammar_queue", "ignore_grammar_cancel", "skip_tool_door_checks"]


@pytest.fixture(scope="module")
def grammar_server(char_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrammarServer]:
    server = GrammarServer(char_dir, tmp_path_factory.mktemp("grammar-server"), pd=False).start()
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def broken_server(char_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrammarServer]:
    """The same server with one FIFO for every tenant's compiles, cancellation ignored and the
    tool door checks skipped."""
    server = GrammarServer(char_dir, tmp_path_factory.mktemp("broken-grammar-server"), pd=False,
                           faults=BREAKING_FAULTS).start()
    yield server
    server.terminate()


def test_another_tenants_small_grammar_is_not_held_up(grammar_server: GrammarServer) -> None:
    alone_s, waited_s = check_b_not_behind_a(grammar_server)
    print(f"colocated: tenant B's small-schema request took {waited_s:.3f} s while A's over-budget grammar "
          f"compiled ({alone_s:.3f} s alone)")


def test_a_client_that_leaves_stops_its_compile(grammar_server: GrammarServer) -> None:
    check_disconnect_cancels_the_compile(grammar_server)


@pytest.mark.parametrize("limit", sorted(OVER_LIMIT_SCHEMAS))
def test_tool_schemas_are_refused_like_response_format(grammar_server: GrammarServer, limit: str) -> None:
    check_tools_refused_like_response_format(grammar_server, limit)


def test_the_number_and_total_size_of_tools_are_bounded(grammar_server: GrammarServer) -> None:
    check_tool_count_is_bounded(grammar_server)
    check_tools_total_is_bounded(grammar_server)


def test_with_one_shared_fifo_b_waits_behind_a(broken_server: GrammarServer) -> None:
    with pytest.raises(AssertionError, match="waited behind"):
        check_b_not_behind_a(broken_server)


def test_with_cancellation_ignored_the_compile_runs_to_the_budget(broken_server: GrammarServer) -> None:
    with pytest.raises(AssertionError, match="cancelled, timeouts"):
        check_disconnect_cancels_the_compile(broken_server)


def test_without_the_tool_door_checks_tools_are_not_refused_by_them(broken_server: GrammarServer) -> None:
    for limit in OVER_LIMIT_SCHEMAS:
        with pytest.raises(AssertionError):
            check_tools_refused_like_response_format(broken_server, limit)
    with pytest.raises(AssertionError):
        check_tools_total_is_bounded(broken_server)
