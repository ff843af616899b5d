"""`shardfit tokenize`: text, JSON lines or Parquet into the token shards data.path memory-maps (data/tokenize.py)."""

from __future__ import annotations

from shardfit.cli.args import ArgumentParser, count


def tokenize(argv: list[str]) -> int:
    parser = ArgumentParser(prog="shardfit tokenize", description=(
        "Tokenize text, JSON lines or Parquet once into token shards that `shardfit train --data.path DIR` "
        "memory-maps. Runs over CPU cores; a re-run after an interruption resumes; DIR is usable once it has "
        "manifest.json."))
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs (as data.path)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the shard directory to write (new or empty)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or the path of a tokenizer.json (default: byte)")
    parser.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet"),
                        help="input format; auto picks by extension")
    parser.add_argument("--text-field", default="text", help="JSON key or Parquet column of the text")
    parser.add_argument("--workers", type=lambda v: count(v, "--workers", "worker processes"),
                        help="processes (default: the CPU cores available)")
    args = parser.parse_args(argv)
    from shardfit.data.tokenize import tokenize_to_shards

    m = tokenize_to_shards(args.inputs, args.out, args.tokenizer, args.format, args.text_field, args.workers)
    print(f"{args.out}: {m['tokens']:,} tokens ({m['dtype']}) in {m['documents']:,} documents, "
          f"{len(m['pieces'])} shards; train with --data.path={args.out} --data.tokenizer={args.tokenizer}")
    return 0
