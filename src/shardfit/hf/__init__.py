"""Hugging Face checkpoints: load safetensors into a sharded model, export a sharded model as safetensors."""

from shardfit.hf.export import export_hf
from shardfit.hf.load import load_hf_checkpoint

__all__ = ["export_hf", "load_hf_checkpoint"]
