"""Tensor and expert parallel over `torch.distributed` (gloo on the CPU, NCCL on GPUs): one replica
split over processes.

- `sharding.py`: `ShardPlan`, which part of each weight a rank holds (heads, MLP slices, vocabulary
  rows), decided from the config; torch only for slicing tensors.
- `layers.py`: the vocabulary-parallel embedding and LM head, the all-reduce closing each split
  sublayer, `EPExperts` (a rank's expert slots), and `ShardedLoad`, what the loader asks of a rank.
- `comm.py`: the process groups and the collectives (bounded by --dist-timeout).
- `messages.py`: the typed messages rank 0 broadcasts (msgspec).
- `kv.py`: `ShardedKVPool`, whole KV pages of every head (gathered/scattered) for HiCache and PD.
- `runtime.py`: rank 0's side (starts the workers, broadcasts steps, EPLB, health, shutdown).
- `worker.py`: ranks 1 .. N - 1 (`python -m strata.distributed.worker`).
- `eplb.py`: redundant experts and their placement from the measured load (pure arithmetic).
- `errors.py`: `RankFailure` (torch-free).

The scheduler, the radix cache and the sampler know nothing of ranks: rank 0 runs them as a single
process would, and the model runner hands each step to `ParallelRuntime.send_step` before its forward.
Nothing here imports the server.
"""
