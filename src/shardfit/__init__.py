"""shardfit: FSDP2 training of large language models that fits more, runs faster and explains its memory."""

__version__ = "0.1.0"
