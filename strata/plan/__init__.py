"""`strata plan`: capacity planning — a fitted cost model and a discrete-event simulation of a deployment.

    cost_model.py  step time = linear in the step's features (rows, decode context, prefill attention;
                   two regimes around the kernel switch), the non-negative relative-error fit, KV
                   transfer rates and the speculative accept rate; JSON in and out
    calibrate.py   this machine's in-process engine -> CostModel (and the tier rates it measures)
    remote.py      a running server or router -> CostModel; the PD handoff through a PD router
    figures.py     JSON figures (one-batch / spec JSON, figures files, calibrations) -> CostModel
    workload.py    what is served: bench datasets over a synthetic tokenizer, a trace file, arrivals
    kv_tiers.py    L1 prefix tree / L2 / L3 by chained block hashes
    replica.py     one replica's scheduler (admission, chunked prefill, KV budget, retraction, drafts)
    cluster.py     the event loop, router (the real policy classes), PD, co-located replicas
    results.py     RequestRecords -> the benchmark's own summary, hit rates per tier, utilisation
    search.py      `size`: the cheapest deployment meeting the SLO
    memory.py      `memory`: on paper, from config.json and spec-sheet figures: weights, Engram table
                   placements (KV gained, prefetch cost), the KV tiers, a MoE draft with redundant experts
    memory_cli.py  its flags and report
    plots.py       PNGs (matplotlib, imported on --plot only)
    cli.py         add_plan_args and the commands

Nothing here imports torch or the engine at import time; only `calibrate` with the engine source
and `memory`'s census (the model built on the meta device) do.
"""
