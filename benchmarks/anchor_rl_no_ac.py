"""The RL anchor (shared/anchors/hf_rl_step.py) without gradient checkpointing: the same script, run unchanged but
for `PreTrainedModel.gradient_checkpointing_enable`, which becomes a no-op. What an RL framework's user gets by
turning `enable_gradient_checkpointing` off (verl's model config, OpenRLHF's --gradient_checkpointing left out) when
the GPU holds the activations: the fair anchor beside shardfit's compute.activation_checkpoint=auto, which keeps
every block's activations where they fit. The log-prob head's chunks stay checkpointed as the anchor writes them.

  python benchmarks/anchor_rl_no_ac.py ANCHOR [the anchor's arguments]   (bench_rl.py --anchor-no-ac)
"""
import json
import runpy
import sys

import transformers

transformers.PreTrainedModel.gradient_checkpointing_enable = lambda self, *args, **kwargs: None
print(json.dumps({"part": "no_ac", "gradient_checkpointing": "disabled"}), flush=True)
anchor = sys.argv[1]
sys.argv = [anchor, *sys.argv[2:]]
runpy.run_path(anchor, run_name="__main__")
