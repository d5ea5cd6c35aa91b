"""The error a parallel engine raises when one of its ranks is gone (torch-free: the engine process's
loop catches it to fail its requests and its health check)."""

from __future__ import annotations


class RankFailure(RuntimeError):
    """A tensor/expert-parallel rank died, or a collective did not complete within --dist-timeout.
    The group cannot compute any more: every request in flight fails and the engine stops."""
