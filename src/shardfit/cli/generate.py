"""`shardfit generate`: text from a Hugging Face directory or a shardfit checkpoint, on one device (shardfit.generate
holds the command's options and the decoding)."""

from __future__ import annotations


def generate(argv: list[str]) -> int:
    from shardfit.generate import main as generate_main

    return generate_main(argv)
