"""`shardfit serve`: the Tinker API in front of the Engine, on this process or on N ranks started by torchrun.

Options are checked, and the config read, before any process starts; under torchrun every rank runs this same
command (rank 0 serves HTTP, every rank runs the command loop: shardfit.serve.server).
"""

from __future__ import annotations

import os
import sys

from shardfit.cli.args import count, number, take_options
from shardfit.cli.launch import RDZV_FLAGS, import_torch_quietly, launch_torchrun, rendezvous_flags
from shardfit.errors import ShardfitError

SERVE_HELP = """\
Serve the Tinker API (the official `tinker` SDK runs against it with only base_url and api_key changed):
training (forward, forward_backward, optim_step, save/load state) and sampling (frozen versions of the weights, or
the current ones).

  shardfit serve [--port P] [--host 127.0.0.1] [--api-key tml-...] [--nproc N] [--config FILE] [--section.key=value ...]

  --port P      TCP port (default 8000; 0: any free port); the URL is printed once the server listens
  --host H      address to bind (default 127.0.0.1). Any other address needs an API key: --api-key, the
                SHARDFIT_API_KEY variable, or one generated into <run_dir>/api_key (mode 0600)
  --api-key K   the key clients must send (starts with tml-, as the SDK requires)
  --nproc N     ranks on this node (torchrun); multi-node flags as for shardfit train

The model is the train config's (--model.name=tiny, --model.path=HF_DIR, parallel.*, compute.*); clients pass that name
(or directory) as base_model. Training is full-parameter unless --lora.rank=R (LoRA adapters of rank R on a frozen
base, docs/lora.md): each training client is then a model of its own. --serve.models=DIR[,DIR...] serves more frozen
models to sample and score; --serve.versions=N caps the frozen versions (samplers' weights) held. Example (Python;
rank=0 asks a server without --lora.rank for every parameter):
  tinker.ServiceClient(base_url=URL, api_key="tml-local").create_lora_training_client(base_model="tiny", rank=0)
"""


def serve(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(SERVE_HELP)
        return 0
    opts, rest = take_options(argv, ("--config", "--nproc", "--port", "--host", "--api-key", *RDZV_FLAGS))
    nproc = count(opts["--nproc"], "--nproc", "processes (omit --nproc for one)") if "--nproc" in opts else 1
    port = number(opts.get("--port", "8000"), "--port", int)
    if not 0 <= port <= 65535:
        raise ShardfitError(f"port {port} is out of range", where="--port", fix="give 0 (any free port) to 65535")
    host = opts.get("--host", "127.0.0.1")
    api_key = opts.get("--api-key") or os.environ.get("SHARDFIT_API_KEY") or None
    launcher = rendezvous_flags(opts)
    try:
        import fastapi  # noqa: F401
        import tinker.proto.tinker_public_pb2  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ShardfitError(f"{e.name} is not installed", where="shardfit serve",
                            fix="pip install 'shardfit[serve]'") from None
    if nproc > 1 or launcher:
        import_torch_quietly()
    from shardfit.config import load_config
    from shardfit.weights.peft_config import adapter_lora_fields

    cfg = load_config(opts.get("--config"), rest, adapter_lora_fields)  # validate before starting any process
    from shardfit.serve.served import served_configs

    served_configs(cfg)  # each --serve.models path a model directory, or one line before any process starts
    if nproc > 1 or launcher:
        from shardfit.parallel.layout import check_layout

        nnodes = int(dict(a.split("=", 1) for a in launcher).get("--nnodes", 1))
        check_layout(cfg, nproc * nnodes)
        # every rank runs `shardfit serve` with the same options (its own --port etc. are read on rank 0 only)
        passed = [f"{k}={v}" for k, v in opts.items() if k in ("--port", "--host", "--api-key")]
        return launch_torchrun(nproc, opts.get("--config"), passed + rest, launcher, command="serve")
    from shardfit.cli.rank_errors import report_error
    from shardfit.parallel import shutdown_distributed
    from shardfit.serve.server import run

    try:
        rc = run(cfg, host=host, port=port, api_key=api_key)
    except ShardfitError as e:  # bad input at start-up, or Stopped (a signal): one line, once per job
        rc = report_error(e)
    finally:
        shutdown_distributed()
    # As after training (cli.main.entry): gloo's worker threads can outlive the process group and abort a
    # finalizing interpreter; everything is written by now, so leave without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
