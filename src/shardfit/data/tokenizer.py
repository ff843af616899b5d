"""Tokenizers: the built-in byte tokenizer, or a Hugging Face `tokenizer.json` through the `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path

from shardfit.errors import ShardfitError


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, plus BOS, EOS and PAD. Lossless for any text."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json`; EOS comes from a `tokenizer_config.json` beside it, else from well-known token names."""

    _EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "</s>", "<eos>")

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ShardfitError("tokenizer file not found", where=str(path),
                                fix="pass data.tokenizer=byte or the path of a tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions for malformed JSON
            raise ShardfitError(f"cannot read tokenizer ({str(e).splitlines()[0]})", where=str(path),
                                fix="give a tokenizer.json saved by the tokenizers library") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(path.parent / "tokenizer_config.json")
        self.bos_id = self.pad_id = None

    def _find_eos(self, config_path: Path) -> int | None:
        names = list(self._EOS_NAMES)
        if config_path.is_file():
            try:
                eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
            except (OSError, json.JSONDecodeError):
                eos = None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.insert(0, eos)
        for name in names:
            tid = self.tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def build_tokenizer(spec: str):
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
