"""Typed messages between the frontend and the engine process (msgspec over ZMQ).

`msgs` defines every message, `codec` turns them into bytes and back, `convert` maps them to
and from the engine's vocabulary, and `engine_proc`/`engine_loop` run an engine behind them.
The prefill/decode split will speak the same messages.
"""
