"""`strata router`: one OpenAI-compatible endpoint over data-parallel `strata serve` replicas.

    config.py       RouterConfig (one frozen dataclass: every `strata router` flag) and URL checks
    worker.py       one replica as the router sees it: health, circuit breaker, load, counters
    pool.py         the set of workers, added and removed at runtime; background health + load polls
    policy.py       the Policy interface and the simple policies (round_robin, random, least_load,
                    power_of_two)
    prefix_tree.py  an approximate radix tree of routed prompts (characters or token ids)
    cache_aware.py  the cache_aware policy: longest prefix match unless load is imbalanced
    registry.py     policy name -> class (the CLI's `--policy` choices)
    proxy.py        forwarding one request: pick, retry elsewhere before the first byte, stream SSE
    metrics.py      the router's Prometheus metrics (`strata:router_*`)
    app.py          the FastAPI app: proxied API, /workers admin, /health, /metrics, API key
    launcher.py     `--launch N`: local `strata serve` replicas as subprocesses
    cli.py          add_router_args / router_main

The router never imports torch or the engine: it speaks HTTP to workers and nothing else.
"""
