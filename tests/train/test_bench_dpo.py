"""benchmarks/bench_dpo.py (issue 38's DPO against TRL): its data reach both systems as the same token ids (shardfit's
tokenizer of data.tokenizer and transformers' PreTrainedTokenizerFast, which TRL tokenizes with), of the lengths its
token counts assume, and dpo_vs_trl is shardfit over TRL."""

import argparse
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


def test_a_variant_is_compared_with_trls_run_of_its_case_and_sets_what_it_names(monkeypatch):
    rows = [{"label": "trl-lora8b", "tok_s": 1000, "peak_alloc_GiB": 20.0},
            {"label": "sf-lora8b-8k-fp8", "tok_s": 2100, "peak_alloc_GiB": 19.0}]
    assert bench_dpo.summarize(rows) == {"dpo_vs_trl": {"lora8b-8k-fp8": {"throughput": 2.1, "memory": 0.95}}}
    seen = {}

    def fake_run(cmd, cap):
        seen["cmd"] = cmd
        return 1, "", "stopped", False, 0.0

    monkeypatch.setattr(bench_dpo, "_run_group", fake_run)
    a = argparse.Namespace(
        sf_ac="full", sf_budget=16384, prompt=8, answer=7, global_batch=2, warmup=1, steps=1, tiny=False, sf_extra="",
        profile_out="")
    bench_dpo.run_shardfit(a, "sf-lora8b-8k-fp8", "8b", True, Path("/nonexistent"), 10)
    assert "--train.micro_batch_tokens=8192" in seen["cmd"] and "--compute.fp8=tensorwise" in seen["cmd"]
    assert "--compute.activation_checkpoint=full" in seen["cmd"]
