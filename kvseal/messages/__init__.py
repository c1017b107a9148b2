"""Typed messages between the frontend and the engine process (msgspec over ZMQ).

`msgs` defines every message, `codec` turns them into bytes and back, `convert` maps them to
and from the engine's vocabulary. The engine's loop behind them is `kvseal.engine.loop`; the
PD roles speak these messages too, plus their own (`kvseal.disagg.msgs`).
"""
