"""A client that goes away mid-request aborts it in the engine; its pages are freed at once."""

from __future__ import annotations

import json
import socket

import httpx
from processes import wait_for
from server_process import MAX_MODEL_LEN, ServerProcess

LONG = {"prompt": "w5 w6 w7", "max_tokens": MAX_MODEL_LEN - 3, "ignore_eos": True}


def test_stream_disconnect_aborts_and_frees_pages(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.base_url}/completions", json=LONG | {"stream": True}, timeout=60,
                      headers={"Authorization": "Bearer key-alice"}) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        next(lines)  # generating now
        assert server.metric("kvseal_kv_pages_used") >= 1
    record = server.audit_for(request_id)
    assert record["outcome"] == "aborted" and record["reason"] == "client_disconnected"
    assert record["output_tokens"] < LONG["max_tokens"]
    assert record["pages_reserved"] >= 1
    wait_for(lambda: server.metric("kvseal_kv_pages_used") == 0, "the pages to be free")
    assert server.metric("kvseal_num_requests_running") == 0


def test_non_stream_disconnect_aborts_too(server: ServerProcess) -> None:
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-bob\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    before = {r["request_id"] for r in server.audit_records()}
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + body)
        wait_for(lambda: server.metric("kvseal_num_requests_running") == 1, "the request to run")
    record = wait_for(lambda: [r for r in server.audit_records() if r["request_id"] not in before],
                      "the audit record")[0]
    assert record["tenant"] == "bob"
    assert record["outcome"] == "aborted" and record["reason"] == "client_disconnected"
    assert record["output_tokens"] < LONG["max_tokens"]
    wait_for(lambda: server.metric("kvseal_kv_pages_used") == 0, "the pages to be free")


def test_disconnect_while_sending_the_body_is_recorded_as_aborted(server: ServerProcess) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-alice\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    before = {r["request_id"] for r in server.audit_records()}
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + b'{"prompt": "w5')
    record = wait_for(lambda: [r for r in server.audit_records() if r["request_id"] not in before],
                      "the audit record")[0]
    assert (record["tenant"], record["outcome"], record["reason"]) == ("alice", "aborted", "client_disconnected")
    assert "pages_reserved" not in record
