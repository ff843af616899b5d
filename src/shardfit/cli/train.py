"""`shardfit train`: check the config and the launch options, then train here or start the ranks (cli.launch)."""

from __future__ import annotations

import os
import signal

from shardfit.cli.args import count, take_options
from shardfit.cli.launch import RDZV_FLAGS, import_torch_quietly, launch_torchrun, rendezvous_flags

TRAIN_HELP = """\
Train a decoder model with FSDP2. With no arguments: the embedded tiny model on the embedded corpus.

  shardfit train [--config FILE.toml | --config recipe:NAME] [--section.key=value ...] [--nproc N]
  shardfit train [...] --nproc N --nnodes M --rdzv-endpoint HOST:PORT [--rdzv-id ID]   (on each of M nodes)
  torchrun --nproc_per_node N -m shardfit train [...]     (multi-node: torchrun's flags as usual)

Ready-made configs: shardfit recipes. Defaults below are those of the model on the command line (add
--model.name=... or --model.path=... before --help to see another model's).

Every key (TOML table [section], or --section.key=value on the command line):
"""

# Set once this process has trained: cli.main.entry then ends it without interpreter finalization (see there).
trained_here = False


def parse_launch(argv: list[str]) -> tuple[int, list[str], str | None, list[str]]:
    """(processes on this node, torchrun's rendezvous flags, --config, the config overrides): every launch option
    checked before the config is read and before any process starts."""
    opts, rest = take_options(argv, ("--config", "--nproc", *RDZV_FLAGS))
    nproc = count(opts["--nproc"], "--nproc", "processes (omit --nproc for one)") if "--nproc" in opts else 1
    return nproc, rendezvous_flags(opts), opts.get("--config"), rest


def train(argv: list[str]) -> int:
    nproc, launcher, config_path, rest = parse_launch(argv)
    if nproc > 1 or launcher:
        import_torch_quietly()  # this process launches: its only C++ logs would be the rendezvous's retries
    from shardfit.config import load_config
    from shardfit.config.loader import config_help
    from shardfit.weights.peft_config import adapter_lora_fields  # torch-free: lora.adapter's files

    nnodes = int(dict(a.split("=", 1) for a in launcher).get("--nnodes", 1))
    if any(a in ("-h", "--help") for a in rest):
        print(TRAIN_HELP + config_help(load_config(config_path, [a for a in rest if a not in ("-h", "--help")],
                                                   adapter_lora_fields)))
        return 0
    cfg = load_config(config_path, rest, adapter_lora_fields)  # validate before starting any process
    if config_path:
        from shardfit.config.recipes import check_needs, read

        recipe = read(config_path)
        if recipe is not None:
            check_needs(recipe, cfg)
    if nproc > 1 or launcher:
        from shardfit.parallel.layout import check_layout

        check_layout(cfg, nproc * nnodes)  # before starting processes: one line, not a traceback per rank
        return launch_torchrun(nproc, config_path, rest, launcher)

    from shardfit.parallel import shutdown_distributed
    from shardfit.train import Trainer, apply_alloc_conf

    apply_alloc_conf(cfg.memory.alloc_conf)  # before torch touches CUDA
    # a torchrun rank dies of SIGTERM at start-up (its launcher speaks); the loop saves on it (train/stop.py)
    previous = None if os.environ.get("TORCHELASTIC_RUN_ID") else signal.signal(signal.SIGTERM, _sigterm)
    global trained_here
    try:
        Trainer(cfg).fit()
    finally:
        shutdown_distributed()
        trained_here = True
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _sigterm(signum, frame):
    from shardfit.errors import SignalInterrupt

    raise SignalInterrupt(signum)
