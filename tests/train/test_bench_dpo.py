"""benchmarks/bench_dpo.py (issue 38's DPO against TRL): its data reach both systems as the same token ids (shardfit's
tokenizer of data.tokenizer and transformers' PreTrainedTokenizerFast, which TRL tokenizes with), of the lengths its
token counts assume, and dpo_vs_trl is shardfit over TRL."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_dpo  # noqa: E402


def test_both_systems_read_the_same_ids(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from shardfit.data.tokenizer import build_tokenizer

    out = bench_dpo.write_data(tmp_path, pairs=3, prompt=7, answer=5, vocab=50)
    ours = build_tokenizer(str(out))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token="</s>", pad_token="</s>")
    for line in (out / "pairs.jsonl").read_text().splitlines():
        rec = json.loads(line)
        prompt, chosen = ours.encode(rec["prompt"]), ours.encode(rec["chosen"])
        assert len(prompt) == 7 and len(chosen) == 5 and ours.eos_id == 49
        assert prompt == [int(w[1:]) for w in rec["prompt"].split()]
        # TRL tokenizes prompt + answer + EOS in one string
        assert hf(rec["prompt"] + rec["chosen"] + "</s>")["input_ids"] == prompt + chosen + [49]


def test_dpo_vs_trl_is_shardfit_over_trl():
    rows = [{"label": "sf-lora8b", "tok_s": 3000, "peak_alloc_GiB": 30.0},
            {"label": "trl-lora8b", "tok_s": 1000, "peak_alloc_GiB": 40.0},
            {"label": "sf-full1b", "tok_s": 500}, {"label": "trl-full1b", "error": "OOM"}]
    assert bench_dpo.summarize(rows) == {"dpo_vs_trl": {"lora8b": {"throughput": 3.0, "memory": 0.75}}}
