"""The server's pieces that need no live server: flags, the socket codec, request validation."""

from __future__ import annotations

import argparse
import dataclasses

import msgspec
import pytest

from strata.config import EngineConfig, add_engine_args
from strata.engine.outputs import RequestOutput, TokenLogprob, TopLogprob
from strata.sampling_params import SamplingParams
from strata.server import io
from strata.server.launch import (
    add_serve_args,
    build_parser,
    engine_config_from_args,
    server_config_from_args,
)
from strata.server.protocol import (
    APIError,
    ChatCompletionRequest,
    decode_body,
    make_sampling_params,
    resolve_max_tokens,
)


def test_serve_flags_cover_every_engine_field_with_its_default():
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()
    flags = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} - {"extra"} <= flags
    # the CLI's subparser, already carrying the engine flags, gets no duplicates
    sub = argparse.ArgumentParser()
    add_engine_args(sub)
    add_serve_args(sub)
    assert server_config_from_args(sub.parse_args(["--port", "1"])).port == 1


def test_engine_flags_parse_types_and_choices():
    args = build_parser().parse_args(
        [
            "--page-size",
            "16",
            "--dtype",
            "float32",
            "--disable-radix-cache",
            "--kv-cache-tokens",
            "4096",
            "--mem-fraction-static",
            "0.1",
            "--port",
            "8080",
            "--api-key",
            "k",
        ]
    )
    cfg = engine_config_from_args(args)
    assert (cfg.page_size, cfg.dtype, cfg.disable_radix_cache, cfg.kv_cache_tokens) == (
        16,
        "float32",
        True,
        4096,
    )
    assert cfg.mem_fraction_static == 0.1
    server = server_config_from_args(args)
    assert (server.port, server.api_key, server.host) == (8080, "k", "127.0.0.1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "float64"])
    with pytest.raises(ValueError, match="page_size"):
        engine_config_from_args(build_parser().parse_args(["--page-size", "0"]))


def test_messages_round_trip_without_pickle():
    req = io.GenerateReq(
        "r1",
        [1, 2, 3],
        SamplingParams(max_new_tokens=5, stop=["x"], logprobs=2, seed=3),
    )
    assert io.decode_to_engine(io.encode(req)) == req
    out = RequestOutput(
        "r1",
        [7],
        "hi",
        True,
        "stop",
        matched_stop=2,
        logprobs=[TokenLogprob(7, -0.5, [TopLogprob(7, -0.5)])],
    )
    batch = io.OutputBatch(
        [out],
        io.EngineStats(
            num_running=1, num_pages=10, num_free_pages=4, num_evictable_pages=1
        ),
    )
    decoded = io.decode_from_engine(io.encode(batch))
    assert decoded == batch and decoded.stats.token_usage == pytest.approx(0.5)
    with pytest.raises(msgspec.DecodeError):
        io.decode_to_engine(
            io.encode(batch)
        )  # an engine->frontend message is not a frontend->engine one


def test_expert_load_travels_on_request_and_renders_one_series_per_expert():
    """A MoE model's per-expert counts ride only in requested stats; /metrics renders them as
    `strata:moe_expert_tokens{layer, expert}` in valid exposition text (label values escaped), and
    the stats sent with outputs (no counts) leave the last ones in place."""
    from prometheus_client.parser import text_string_to_metric_families

    from strata.layers.expert_load import expert_load_summary
    from strata.server.metrics import ServerMetrics

    assert io.decode_to_engine(
        io.encode(io.StatsReq(3, expert_load=True))
    ) == io.StatsReq(3, True)
    load = {0: [5, 0, 3], 2: [1, 1, 6]}
    stats = io.EngineStats(
        num_running=1, expert_load=load, expert_load_summary=expert_load_summary(load)
    )
    decoded = io.decode_from_engine(io.encode(io.StatsResult(1, stats)))
    assert (
        decoded.stats == stats and decoded.stats.expert_load == load
    )  # layer keys stay ints
    metrics = ServerMetrics('tiny "moe"\\')
    metrics.on_stats(stats)
    metrics.on_stats(io.EngineStats())  # as sent with a batch of outputs
    families = {
        f.name: f for f in text_string_to_metric_families(metrics.render().decode())
    }
    experts = families["strata:moe_expert_tokens"]
    assert experts.type == "gauge"
    assert {
        (s.labels["layer"], s.labels["expert"]): s.value for s in experts.samples
    } == {
        ("0", "0"): 5,
        ("0", "1"): 0,
        ("0", "2"): 3,
        ("2", "0"): 1,
        ("2", "1"): 1,
        ("2", "2"): 6,
    }
    assert {s.labels["model_name"] for s in experts.samples} == {'tiny "moe"\\'}
    assert "strata:num_running_reqs" in families
    assert "moe_expert_tokens" not in ServerMetrics("dense").render().decode()


def test_max_tokens_defaults_and_limits():
    assert (
        resolve_max_tokens(None, 10, 512, 10_000, default=None) == 502
    )  # to the end of the context
    assert (
        resolve_max_tokens(None, 10, 512, 100, default=None) == 91
    )  # ... bounded by the KV pool
    assert resolve_max_tokens(None, 10, 512, 10_000, default=16) == 16
    assert resolve_max_tokens(20, 10, 512, 10_000, default=16) == 20
    with pytest.raises(APIError, match="at most 502") as e:
        resolve_max_tokens(600, 10, 512, 10_000, default=None)
    assert e.value.param == "max_tokens" and e.value.status == 400
    with pytest.raises(APIError, match="512"):
        resolve_max_tokens(None, 512, 512, 10_000, default=None)
    with pytest.raises(APIError, match="at least 1"):
        resolve_max_tokens(0, 10, 512, 10_000, default=None)


def test_sampling_errors_name_the_clients_field():
    with pytest.raises(APIError) as e:
        make_sampling_params(
            {"max_new_tokens": 4, "min_new_tokens": 9},
            100,
            {"min_new_tokens": "min_tokens"},
        )
    assert e.value.param == "min_tokens" and e.value.message.startswith("min_tokens")
    with pytest.raises(APIError, match="top_p"):
        make_sampling_params({"top_p": 0.0}, 100)


@pytest.mark.parametrize(
    "body,param",
    [
        (b"{", None),
        (b"\xff", None),
        (b"", None),
        (b'{"messages": 3}', "messages"),
        (b"{}", "messages"),
    ],
)
def test_bad_bodies_are_400s(body, param):
    with pytest.raises(APIError) as e:
        decode_body(body, ChatCompletionRequest)
    assert e.value.status == 400 and e.value.param == param
