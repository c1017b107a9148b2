"""Prefill/decode disaggregation: a prefill engine computes the prompt's KV and hands it to a
decode engine through a KV transport, under a fail-closed protocol
(docs/ARCHITECTURE.md, "Prefill/decode disaggregation").

    msgs.py          every message of the protocol (one registry)
    transport.py     the transport interface; tcp.py the built-in TCP transport; wire.py ZMQ links
    reservations.py  decode's "receiving" pages; verify.py decode's check of a commit
    prefill.py, decode.py   each role's steps (role.py: what a role is); router_link.py an engine's
                     ROUTER within the loop every engine shares (kvseal.engine.loop)
    config.py        NodeConfig and the PD flags; node.py, engine_main.py `kvseal engine`
    frontend.py      the PD backend (kvseal.engine_api.EngineBackend); metrics.py its gauges
    topology.py, serve.py   `kvseal serve --pd` / `--prefill/--decode`: the engines, started or given
"""
