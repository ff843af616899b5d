"""Why transformers' `generate_batch` (the anchor's hf-cb, ../shared/anchors/hf_sampling.py) produced no token on the
device in session 21 (64 rows of 512 + 256 tokens, Qwen3-8B shape: 0 tokens in 0.28 s, 52.5 GiB at peak), where the
same call on the CPU (transformers 5.17.0 and 5.25.0, a tiny Qwen3) produces every token. The anchor counts
`generated_tokens` and drops each output's `error` and `status`; this prints them, for a few row counts, with the
anchor's own model builder and generation settings, so that the anchor's figure can be read (or its failure named).

  python benchmarks/diag_hf_cb.py [--rows 1,8,64] [--prompt 512] [--new 16]     # one GPU (carry .anchors)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchor", default=str(HERE.parent / ".anchors" / "hf_sampling.py"))
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=16)
    a = ap.parse_args()
    import torch
    import transformers
    from transformers import GenerationConfig

    spec = importlib.util.spec_from_file_location("hf_sampling", a.anchor)
    anchor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(anchor)
    model = anchor.build("8b")
    vocab = anchor.SHAPES["8b"][6]
    g = torch.Generator().manual_seed(0)
    kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=True, temperature=1.0, eos_token_id=-1,
              pad_token_id=0)
    for rows in [int(r) for r in a.rows.split(",")]:
        prompts = torch.randint(10, vocab - 1, (rows, a.prompt), generator=g).tolist()
        t = time.perf_counter()
        try:
            out = model.generate_batch(inputs=prompts, generation_config=GenerationConfig(**kw))
        except Exception as e:  # the failure itself is the finding
            print(json.dumps({"rows": rows, "raised": f"{type(e).__name__}: {e}"[:500]}), flush=True)
            continue
        torch.cuda.synchronize()
        vals = list(out.values())
        print(json.dumps({"transformers": transformers.__version__, "rows": rows, "outputs": len(vals),
                          "seconds": round(time.perf_counter() - t, 2),
                          "tokens": [len(v.generated_tokens or []) for v in vals][:8],
                          "errors": sorted({str(getattr(v, "error", None))[:300] for v in vals}),
                          "status": sorted({str(getattr(v, "status", None)) for v in vals}),
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
