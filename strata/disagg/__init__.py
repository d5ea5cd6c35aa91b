"""Prefill/decode disaggregation: a prefill worker computes a prompt's KV and first token, then
pushes the KV into slots a decode worker reserved for it; the decode worker continues generating.

    router ─┬─ request + room (signed) ────────────▶ prefill worker
            └─ request + room + KV addr (signed) ──▶ decode worker: reserves pages
               prefill ◀── Hello(room, prompt digest, nonce) ── decode
               prefill ── KV(room, nonce, first token) + pages ─▶ decode: installs them, decodes

Trust: the router, the prefill and the decode workers share one secret. `auth.py` (torch-free, used
by the HTTP frontend and the router) signs and checks the bootstrap fields the router hands each
worker, so no other client can announce rooms or point a decode worker anywhere. `protocol.py`
defines the worker-to-worker messages, each MAC'd with the secret and bound to one request by a
prompt digest and a nonce of the decode side's choosing. `transport.py` moves frames (ZMQ over TCP;
Mooncake or NIXL would implement the same small interface) and caps their size and count before
anything is parsed. `manager.py` holds each side's per-room state machine (bootstrapping → waiting
for input → transferring → done | failed) and validates every field that arrives; a bad message is
rejected and counted, never raised into the engine's step.
Nothing here imports the HTTP server; only manager.py imports torch.
"""
