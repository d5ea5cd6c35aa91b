from __future__ import annotations

import pytest

from strata.server.config import ServerConfig
from strata.server.launch import build_parser, server_config_from_args


def test_the_stall_timeout_is_a_flag_and_must_be_positive():
    args = build_parser().parse_args(["--health-stall-timeout", "2.5"])
    assert server_config_from_args(args).health_stall_timeout == 2.5
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="health_stall_timeout must be > 0"):
            ServerConfig(health_stall_timeout=bad)
