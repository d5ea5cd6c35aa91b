"""Benchmarks an operator needs, and the peers measured beside Strata.

What lives here (one concept per file):
  datasets.py        workloads made locally from a tokenizer's vocabulary (random, shared-prefix,
                     multi-turn) or read from a user's JSONL file; deterministic for a seed
  metrics.py         per-request timings -> TTFT / TPOT / ITL / E2E statistics and run throughput
  window.py          the steady-state window (20% .. 90% of requests completed)
  http_client.py     one streamed request to any OpenAI-compatible server -> a RequestRecord
  server_info.py     what a server tells about itself (/v1/models, /get_server_info, /metrics)
  serving.py         the serving benchmark driver: Poisson arrivals, concurrency limit, multi-turn
  step_timer.py      times the pieces of one engine step from outside (schedule/prepare/model/sample)
  one_batch.py       fixed batch x input x output on the offline Engine (prefill tok/s, decode ms/step)
  offline.py         offline Engine throughput on a dataset (and a MoE model's expert load)
  kv_layout.py       KV bytes per token from a config.json: the pool's, and MLA vs per-head K/V
  hf_baseline.py     the transformers baseline (one-batch loop and batched generate())
  llamacpp.py        the llama.cpp peer through llama-cpp-python (optional; detected, never required)
  server_process.py  start/stop a server subprocess on a free port
  targets.py         the things `compare` measures: strata, transformers, llamacpp, url=...
  compare.py         the same workload on several targets, alternating round by round; medians, ratios
  soak.py            `bench soak`: a router, replicas sharing L3 and a PD pair under mixed load while
                     faults are injected; soak_cluster.py its processes, soak_load.py the clients and
                     how each answer is judged, soak_faults.py the faults and /health timings,
                     soak_config.py its options (import-light, for the parser)
  report.py          terminal tables and JSON; progress.py the progress bar; plots.py PNGs
  cli.py             `strata bench serving | one-batch | offline | compare | moe | kv-layout | soak | ...`
                     (flags, commands);
                     compare_cli.py what one compare run measures in each mode

Nothing here is imported by the engine or the server; the engine is only driven through its public
API (`Engine.add_request` / `Engine.step`) and, for timing, wrapped from outside (step_timer.py).
"""
