"""Data: tokenizers, document readers, packing and the resumable sampler."""

from shardfit.data.packing import MicroBatch, PackedDataset, build_dataset, tokenize_corpus
from shardfit.data.sources import read_documents
from shardfit.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "MicroBatch", "PackedDataset", "build_dataset", "build_tokenizer",
           "read_documents", "tokenize_corpus"]
