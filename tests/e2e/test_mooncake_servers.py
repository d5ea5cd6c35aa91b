"""Two `strata serve` replicas sharing a Mooncake store as L3: a long prefix computed on the first is
a storage hit on the second, with the same greedy tokens (the check the file and redis backends pass)."""

from __future__ import annotations

import pytest
from test_hicache_servers import hicache_args, shared_prefix_hits

pytestmark = pytest.mark.e2e


def test_two_servers_share_a_mooncake_store(mooncake_master):
    # each replica lends the store 64 MiB of its memory
    path = f"{mooncake_master.url}?global_segment_size={64 << 20}&local_buffer_size={16 << 20}"
    shared_prefix_hits(hicache_args("mooncake", path))
