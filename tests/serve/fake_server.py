"""`python -m tests.serve.fake_server RUN_DIR`: the server's HTTP side and command loop on the one-process fake Engine
in a process of its own (prints `listening on URL`; SIGTERM stops it), for tests that limit what it may write."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from shardfit.serve.server import start_rank0
from tests.serve.fake_engine import RL_TYPES, FakeEngine, tiny_config


def main(run_dir: str) -> None:
    cfg = tiny_config(Path(run_dir).parent, f"--logging.run_dir={run_dir}")
    serving = start_rank0(cfg, FakeEngine(cfg), port=0, rl_types=RL_TYPES, poll_s=2.0, max_body=1 << 20)
    signal.signal(signal.SIGTERM, lambda *_: serving.state.scheduler.close())
    print(f"listening on {serving.url}", flush=True)
    try:
        serving.loop.run()
    finally:
        serving.stop()


if __name__ == "__main__":
    main(sys.argv[1])
