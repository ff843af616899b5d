"""Model implementations. No distributed code here: see shardfit.parallel for sharding."""

from shardfit.models.decoder import CausalLM, count_params
from shardfit.models.loss import fused_linear_cross_entropy

__all__ = ["CausalLM", "build_model", "count_params", "fused_linear_cross_entropy", "param_count"]


def build_model(cfg, loss_chunk: int = 1024) -> CausalLM:
    """Construct the model on the current default device (use `torch.device("meta")` to allocate nothing)."""
    return CausalLM(cfg, loss_chunk=loss_chunk)


def param_count(cfg) -> int:
    """The parameters of the model `cfg` (a ModelConfig) describes, counted as built (tied weights once, every
    expert) on the meta device: no memory, ~0.1 s at 70B. The config's size-based defaults ask it."""
    import torch

    with torch.device("meta"):
        return count_params(build_model(cfg))
