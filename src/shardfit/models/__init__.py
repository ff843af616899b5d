"""Model implementations. No distributed code here: see shardfit.parallel for sharding."""

from shardfit.models.decoder import CausalLM, count_params
from shardfit.models.loss import fused_linear_cross_entropy

__all__ = ["CausalLM", "build_model", "count_params", "fused_linear_cross_entropy"]


def build_model(cfg, loss_chunk: int = 1024) -> CausalLM:
    """Construct the model on the current default device (use `torch.device("meta")` to allocate nothing)."""
    return CausalLM(cfg, loss_chunk=loss_chunk)
