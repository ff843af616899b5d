# ruff: noqa -- Copied unchanged from ../shared/anchors/torchtitan/make_assets.py (torchtitan's offline assets) so that device calls carry it.
"""Offline assets for torchtitan: a word-level tokenizer.json of exactly V tokens ("t0".."t{V-1}", the last two are
BOS/EOS) and a local JSON-lines text dataset of uniformly random words, so the token ids a model sees are uniform
random ids in [0, V-2), like the synthetic tokens of shardfit and the anchors.

  python make_assets.py OUTDIR            # OUTDIR/tok128256, OUTDIR/tok151936, OUTDIR/synth/train.jsonl
"""
import json
import os
import random
import sys

from tokenizers import Tokenizer, models, pre_tokenizers


def make_tokenizer(path: str, V: int) -> None:
    os.makedirs(path, exist_ok=True)
    vocab = {f"t{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos, eos = f"t{V - 2}", f"t{V - 1}"
    tok.add_special_tokens([bos, eos])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "add_bos_token": False, "add_eos_token": False,
                   "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    assert Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size() == V


def make_dataset(path: str, V: int, docs: int, words: int, seed: int = 0) -> None:
    os.makedirs(path, exist_ok=True)
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(V - 2)]
    with open(os.path.join(path, "train.jsonl"), "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choices(names, k=words))}) + "\n")


if __name__ == "__main__":
    out = sys.argv[1]
    make_tokenizer(os.path.join(out, "tok128256"), 128256)
    make_tokenizer(os.path.join(out, "tok151936"), 151936)
    # 96 documents of 16,384 words: 1.6M tokens per pass; torchtitan re-loops the data when it runs out
    make_dataset(os.path.join(out, "synth"), 128256, docs=96, words=16384)
    print("assets in", out)
