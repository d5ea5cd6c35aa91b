"""strata.ports.free_port: ports outside the ephemeral range, never twice, bindable."""

from __future__ import annotations

import socket

from strata import ports


def test_ports_are_below_the_ephemeral_range_and_never_repeat():
    top = ports.ephemeral_start()
    seen = [ports.free_port() for _ in range(50)]
    assert len(set(seen)) == 50
    assert all(ports.LOWEST <= p < top for p in seen)
    for p in seen[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_held_port_is_not_handed_out(monkeypatch):
    """A port someone listens on is skipped; with a tiny range the kernel's choice is used."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.LOWEST))
        busy.listen(1)
        monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST + 101)
        got = {ports.free_port() for _ in range(20)}
        assert ports.LOWEST not in got
        monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST + 1)
        assert ports.free_port() >= 1024
