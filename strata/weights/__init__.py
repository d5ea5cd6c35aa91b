"""Weights: finding a model directory (or converting a GGUF into one) and loading safetensors into our modules."""
