# ruff: noqa -- Copied unchanged from ../shared/anchors/torchtitan/tt_launch.py (torchtitan 0.2.2 launcher) so that device calls carry it.
"""torchtitan (0.2.x) launcher: its own Trainer and main, plus two additions that change no training behaviour:

1. a flavor "30B-A3B-<L>L" of its Qwen3 MoE: the 30B-A3B arguments with n_layers = $TT_MOE_LAYERS (default 16);
2. one JSON line per logged step and rank ("TTJSON {...}"): torchtitan's own tokens/s and MFU (computed exactly as
   its MetricsProcessor.log does, just before it runs) and the CUDA allocator's peak allocated / reserved / active
   bytes and retries since the last log (torchtitan resets the peaks after each log).

  torchrun --standalone --nproc_per_node 2 tt_launch.py --model.name qwen3 --model.flavor 30B-A3B-16L ...
"""
import copy
import json
import os
import time

import torch

from torchtitan.components import metrics as _metrics
from torchtitan.models.qwen3 import qwen3_args

_L = int(os.environ.get("TT_MOE_LAYERS", "16"))
_a = copy.deepcopy(qwen3_args["30B-A3B"])
_a.n_layers = _L
qwen3_args[f"30B-A3B-{_L}L"] = _a

_orig_log = _metrics.MetricsProcessor.log


def _log(self, step, *args, **kwargs):
    dt = time.perf_counter() - self.time_last_log
    tps = self.ntokens_since_last_log / (dt * self.parallel_dims.non_data_parallel_size)
    st = torch.cuda.memory_stats()
    loss = args[0] if args else kwargs.get("global_avg_loss")
    rec = dict(rank=int(os.environ.get("RANK", 0)), step=step, loss=float(loss), tps=tps,
               mfu_pct=100 * self.num_flops_per_token * tps / self.gpu_peak_flops,
               flops_per_token=self.num_flops_per_token, peak_flops=self.gpu_peak_flops,
               peak_alloc_GiB=st.get("allocated_bytes.all.peak", -1) / 2**30,
               peak_reserved_GiB=st.get("reserved_bytes.all.peak", -1) / 2**30,
               peak_active_GiB=st.get("active_bytes.all.peak", -1) / 2**30,
               retries=st.get("num_alloc_retries", -1), ooms=st.get("num_ooms", -1))
    print("TTJSON " + json.dumps(rec), flush=True)
    return _orig_log(self, step, *args, **kwargs)


_metrics.MetricsProcessor.log = _log

if __name__ == "__main__":
    from torchtitan.train import main, Trainer

    main(Trainer)
