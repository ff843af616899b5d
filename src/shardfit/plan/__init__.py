"""`shardfit plan`: predict a rank's peak GPU memory before launch, choose the micro-batch, propose what fits.

No GPU and no weights are needed: blocks run on the meta device (shapes only). The modules call one way, each only
those below it:
  torch_internals   every private PyTorch API the planner uses, looked up when first needed (one clear error)
  moe               the mixture-of-experts terms (arithmetic; parallel/expert.py decides the layout)
  adapters          the LoRA and QLoRA terms: a frozen base as stored, the adapters, the adapted block
  activation_trace  what one block saves for backward, eager or compiled, per checkpointing mode
  checks            the planner's inputs, one line for each bad number or impossible model
  estimate          one rank's peak, term by term (states, fsdp, activations, working, host)
  micro_batch       the largest micro-batch that fits (`train.micro_batch=0` at start-up)
  table             the report of `shardfit plan`
  proposals         configurations that fit, and the JSON report
  models            LoRA models and frozen versions on one base, and a pass of several models
  sampler           in-process sampling: the decode model and the KV cache (sampling/kv.py's arithmetic)
  served            shardfit serve's frozen extra models (--serve.models): their weights, and the KV cache after them
The snapshot doctor (shardfit.doctor) explains measured memory; this package predicts it. Design and the
measurements that check it: docs/memory-plan.md.
"""
