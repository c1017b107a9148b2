"""Prefill/decode disaggregation: a prefill engine computes the prompt's KV and hands it to a
decode engine through a KV transport, under a fail-closed protocol (DESIGN.md §3).

    msgs.py          every message of the protocol (one registry)
    transport.py     the transport interface; tcp.py the built-in TCP transport; wire.py ZMQ links
    reservations.py  decode's "receiving" pages; verify.py decode's check of a commit
    prefill.py, decode.py   each role's steps; engine_loop.py the loop every role shares
    node.py, engine_main.py `kvseal engine`; frontend.py the PD frontend's engine client
"""
