"""Prefill/decode disaggregation: a prefill worker computes a prompt's KV and first token, then
pushes the KV into slots a decode worker reserved for it; the decode worker continues generating.

    router ──request + (bootstrap addr, room)──▶ prefill worker        decode worker ◀── same request
                                                    │   ◀── Hello(room, kv endpoint) ──  reserves pages
                                                    │── KV(room, first token) + pages ─▶ installs, decodes

`transport.py` moves frames (ZMQ over TCP; Mooncake or NIXL would implement the same small
interface), `protocol.py` defines the authenticated messages, `manager.py` holds each side's
per-room state machine (bootstrapping → waiting for input → transferring → done | failed).
Nothing here imports the HTTP server.
"""
