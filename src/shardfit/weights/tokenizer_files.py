"""The tokenizer files of an export, for every tokenizer shardfit trains with, so that `AutoTokenizer` loads them.

A Hugging Face tokenizer's files are copied from the directory of its tokenizer.json (`tokenizer_source`). The
built-in byte tokenizer (data/tokenizer.py: UTF-8 bytes as ids 0-255, then BOS, EOS and PAD) is written as its
exact equivalent in the tokenizers library: a byte-level BPE with GPT-2's byte alphabet and no merges (every byte
one token, its id the byte), the three special tokens at 256-258, and `split_special_tokens` so that text that
spells "<eos>" is encoded as its bytes, as shardfit's tokenizer does. Decoding joins the bytes and reads UTF-8.
`eos_ids`: the ids that end a model's answer, from its tokenizer and its directory's generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardfit.data.tokenizer import ByteTokenizer

SPECIAL = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}


def tokenizer_source(spec: str) -> str | None:
    """The directory to copy a tokenizer's files from (data.tokenizer: a tokenizer.json or its directory); None for
    the byte tokenizer, whose files are written instead."""
    if spec == "byte":
        return None
    return str(Path(spec).parent if Path(spec).suffix == ".json" else Path(spec))


def eos_ids(tokenizer, model_dir: Path | None) -> set[int]:
    """The tokenizer's EOS and generation_config.json's eos_token_id (an int or a list: chat models end a turn with
    their own token, e.g. Llama-3's <|eot_id|>)."""
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    gen_cfg = model_dir / "generation_config.json" if model_dir else None
    if gen_cfg is not None and gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text(encoding="utf-8")).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else {eos} if isinstance(eos, int) else set()
    return ids


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the ByteLevel pre-tokenizer's mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


def write_byte_tokenizer(out: Path, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json for ByteTokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    t = ByteTokenizer
    alphabet = _byte_alphabet()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SPECIAL[k], special=True) for k in ("bos_token", "eos_token", "pad_token")])
    assert [tok.token_to_id(SPECIAL[k]) for k in ("bos_token", "eos_token", "pad_token")] == \
        [t.bos_id, t.eos_id, t.pad_id]
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "split_special_tokens": True, "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": t.bos_id, "eos_token_id": t.eos_id, "pad_token_id": t.pad_id}, indent=2))
