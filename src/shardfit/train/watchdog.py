"""A per-rank watchdog that turns a silent hang into a report and an exit.

The training loop records where it is (step, micro-batch, phase) with `beat()`: an attribute store, no syscall,
no device sync. A daemon thread checks the age of the last beat; after `timeout_s` without progress it writes to
<run_dir>/hang_rank<r>.txt (and stderr) where the rank stalled and the Python stacks of all its threads, adds the
NCCL flight recorder's trace when this PyTorch build keeps one (TORCH_NCCL_TRACE_BUFFER_SIZE > 0), and exits with
code 5. Every rank runs its own: the stalled rank and the ranks waiting for it in a collective all report. The
exit waits a short grace period after the dump, so that peers waiting in the same collective (whose timers expire
at about the same moment) dump theirs before this rank's exit breaks their connections.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

EXIT_CODE = 5


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, run_dir: Path):
        self.timeout_s, self.rank, self.run_dir = timeout_s, rank, run_dir
        self.where = "start-up"
        self.last = time.monotonic()
        self._stop = threading.Event()
        self.fired = threading.Event()
        self.grace_s = max(2.0, min(30.0, timeout_s / 4))
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="shardfit-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self.stop)  # also when the owner never calls stop() (see stop)

    def beat(self, where: str) -> None:
        self.where = where
        self.last = time.monotonic()

    def stop(self) -> None:
        """End the thread and wait for it: a daemon thread still running at interpreter exit is ended by
        pthread_exit, which some CPython builds (Debian's 3.11) turn into a C++ 'terminate called' abort."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if time.monotonic() - self.last > self.timeout_s:
                self._fire()

    def _fire(self) -> None:
        msg = (f"shardfit: rank {self.rank}: no progress for {self.timeout_s:.0f} s at {self.where}; a rank is "
               f"stalled or skipped a collective. Stacks in {self.run_dir}/hang_rank{self.rank}.txt; exiting")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / f"hang_rank{self.rank}.txt", "w") as f:
                f.write(msg + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            self._dump_nccl_trace()
        finally:
            print(msg, file=sys.stderr, flush=True)
            self.fired.set()
            time.sleep(self.grace_s)
            os._exit(EXIT_CODE)

    def _dump_nccl_trace(self) -> None:
        try:
            import torch.distributed as dist

            dump = getattr(dist.distributed_c10d.torch._C._distributed_c10d, "_dump_nccl_trace", None)
            if dump is not None and os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") != "0":
                (self.run_dir / f"hang_rank{self.rank}.nccl_trace").write_bytes(dump())
        except Exception:  # best effort: the stacks are already on disk
            pass
