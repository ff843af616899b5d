"""`shardfit export RUN_OR_STEP OUT`: a shardfit checkpoint as a Hugging Face model directory, in one process.

The checkpoint (a step_XXXXXXXX directory, or a run or checkpoints directory: its newest whole checkpoint) is
checked whole (the line printed at the end names its step) and read through the checked loader (weights/local.py's
load_dcp: checkpoint_verify, nothing unpickled) into one unsharded model on the CPU, whatever number of ranks wrote it
and in whatever layout; the Engine's own exporter (weights/hf_export.py, through weights/local.py's write_hf) then
writes it with the run's tokenizer files, the byte tokenizer's included, so that transformers' AutoModelForCausalLM
and AutoTokenizer load OUT; a LoRA run's adapters are merged into its base. OUT must be new, empty, or a previous
export (replaced whole).
"""

from __future__ import annotations

from pathlib import Path

from shardfit.cli.args import ArgumentParser
from shardfit.errors import ShardfitError

DTYPES = ("bfloat16", "float32", "float16")


def export(argv: list[str]) -> int:
    parser = ArgumentParser(prog="shardfit export", description=(
        "Write a shardfit checkpoint as a Hugging Face model directory (safetensors, config.json, tokenizer files) "
        "that transformers loads; one process on the CPU, from a checkpoint written by any number of ranks."))
    parser.add_argument("checkpoint", metavar="RUN_OR_STEP", help="a run directory (its newest complete "
                        "checkpoint), a checkpoints directory, or a step_XXXXXXXX directory")
    parser.add_argument("out", metavar="OUT", help="the directory to write (new, empty, or a previous export)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the weights (default "
                        "bfloat16, as checkpoint.export_dtype)")
    parser.add_argument("--tokenizer", help="tokenizer.json or 'byte' (default: the run's data.tokenizer)")
    args = parser.parse_args(argv)
    from shardfit.weights.hf_export import export_problem

    out = Path(args.out)
    problem = export_problem(out)
    if problem:
        raise ShardfitError(f"{out} {problem}", where="OUT", fix="export to a new or empty directory, or remove it")
    import torch

    from shardfit.weights.local import load_dcp, write_hf

    saved: dict = {}
    model, spec = load_dcp(args.checkpoint, torch.device("cpu"), torch.float32, saved=saved)
    spec = args.tokenizer or spec
    if spec != "byte" and not Path(spec).exists():
        raise ShardfitError(f"the run's tokenizer {spec} is not found", where="data.tokenizer",
                            fix="run shardfit export from the directory the run was started in, or give --tokenizer")
    write_hf(model, out, args.dtype, spec, saved.get("chat_template", ""))
    from shardfit.adapters.lora import is_adapter
    from shardfit.adapters.quantized import quantized_modules
    from shardfit.models import count_params

    n = count_params(model) - sum(p.numel() for name, p in model.named_parameters() if is_adapter(name))
    quantized = quantized_modules(model)
    label = quantized[0][1].LABEL if quantized else ""
    rounding = f"; the base dequantised from {label}: its weights carry {label}'s rounding" if quantized else ""
    from shardfit.weights.checkpoint import step_of

    ckpt = Path(saved["where"]).parent  # the step_XXXXXXXX directory load_dcp chose (a run's: its newest)
    print(f"exported step {step_of(ckpt)} ({ckpt}) to {out}: {n / 1e6:.1f}M parameters in {args.dtype}, tokenizer "
          f"{'byte (written as tokenizer.json)' if spec == 'byte' else spec}{rounding}")
    return 0
