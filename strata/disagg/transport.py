"""Frame transport between workers. `KVTransport` is the interface; `TRANSFER_BACKENDS` names the
implementations (`--disaggregation-transfer-backend`): `tcp` is `ZmqTransport`, one PULL inbox per
worker and PUSH sockets to peers opened on first use; `mooncake` (mooncake_transport.py) sends the
same messages but moves KV payloads with Mooncake's transfer engine. Both are built on
zmq_transport.py, which also holds the interface and the inbox's bounds on what it reads.
"""

from __future__ import annotations

from strata.disagg.zmq_transport import KVTransport, ZmqTransport

__all__ = ["TRANSFER_BACKENDS", "KVTransport", "ZmqTransport", "make_transport"]


def _mooncake(host: str, port: int, max_payload_bytes: int) -> KVTransport:
    from strata.disagg.mooncake_transport import MooncakeTransport

    return MooncakeTransport(host, port, max_payload_bytes=max_payload_bytes)


TRANSFER_BACKENDS = {"tcp": ZmqTransport, "mooncake": _mooncake}


def make_transport(
    backend: str, host: str, port: int, max_payload_bytes: int
) -> KVTransport:
    """The worker's transport: its inbox at host:port (0: any free port), taking KV payloads up to
    max_payload_bytes. Raises ValueError naming what is missing when a backend cannot start."""
    if backend not in TRANSFER_BACKENDS:
        choices = ", ".join(TRANSFER_BACKENDS)
        raise ValueError(
            f"unknown KV transfer backend {backend!r}; choose one of {choices}"
        )
    return TRANSFER_BACKENDS[backend](host, port, max_payload_bytes=max_payload_bytes)
