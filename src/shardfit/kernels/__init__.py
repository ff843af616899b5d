"""GPU kernels (Triton), each with the same arithmetic in PyTorch ops for tensors they do not take (in the kernel's
module, or, for nf4_dequant.py, in adapters/nf4.py, which chooses); their callers live in the packages that use them."""

from shardfit.kernels.scaled_accumulate import scaled_accumulate_, scaled_cast

__all__ = ["scaled_accumulate_", "scaled_cast"]
