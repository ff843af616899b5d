"""Sampling: continuous batching over a paged KV cache, the decode model of an Engine and its bank of LoRA adapters
(docs/architecture.md)."""
