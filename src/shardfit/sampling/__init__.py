"""Sampling from a plain (unsharded) CausalLM: continuous batching over a paged KV cache, the draw on the device.

params.py (SamplingParams, SampleRequest, the results, the submit-time checks), kv.py (the paged cache and its
block allocator), attention.py (attention over a row's blocks), sample.py (greedy and seeded Gumbel-max draws,
top-k/top-p, log-probs), step.py (the rows' device state and the decode step), scheduler.py (admission, blocks,
preemption), graphs.py (the decode step as CUDA graphs), runner.py (Sampler: submit, step, run), reference.py (the
one-prompt loop over the dense cache it is checked against); for Engine.sample, source.py (the decode model over an
Engine's own weights) and lora_bank.py (its LoRA layers holding several adapter versions at once, rows of each in one
batch). It imports models, config and the layers below; engine/, serve/ and cli/ use it.
"""

from shardfit.sampling.params import Sampled, SampleRequest, SampleResult, SamplingParams
from shardfit.sampling.runner import SampleHandle, Sampler

__all__ = ["Sampled", "SampleHandle", "SampleRequest", "SampleResult", "Sampler", "SamplingParams"]
