"""Data: tokenizers, document readers, packing and the resumable sampler, token shards.

The names below load on first use: `shardfit tokenize` and its worker processes import shardfit.data.token_shards,
which needs numpy and the tokenizers but not torch (packing imports it: ~1-3 s a process).
"""

import importlib

_EXPORTS = {
    "MicroBatch": "dataset", "PackedDataset": "packing", "build_dataset": "build", "tokenize_corpus": "packing",
    "read_documents": "sources",
    "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer", "build_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardfit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"shardfit.data.{_EXPORTS[name]}"), name)
