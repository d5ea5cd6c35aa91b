"""Building blocks shared by model families: rotary embeddings, norms, paged attention, sampling.

Layers are plain PyTorch modules/functions; they know nothing of requests or the scheduler.
"""
