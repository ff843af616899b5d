"""Start `shardfit serve` as a subprocess for the Tinker SDK examples, and stop it afterwards.

The examples call `local_server(args)` when no --base-url is given: the server binds a free port on 127.0.0.1
(--port=0) and prints `shardfit serve: listening on http://HOST:PORT ...` once it accepts connections; the URL is
read from that line. On loopback with no key configured the server lets in any key the SDK accepts (`tml-...`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

LOCAL_KEY = "tml-local"  # any tml- key: the server on loopback needs none, the SDK refuses a key without the prefix


def common_args(parser) -> None:
    """The options every example takes to reach (or start) a server."""
    parser.add_argument("--base-url", default=None,
                        help="a running `shardfit serve --model.name=tiny` (default: start one on 127.0.0.1)")
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", LOCAL_KEY),
                        help="the server's key (a server off loopback writes its key to <run_dir>/api_key)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and the sampler")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `shardfit serve` option when the example starts the server, e.g. "
                             "--server-arg=--nproc=2 (repeatable)")


@contextlib.contextmanager
def local_server(args: list[str], timeout_s: float = 300.0) -> Iterator[str]:
    """`python -m shardfit serve --port=0 ARGS` in its own process group; yields its URL, stops it on exit."""
    with tempfile.TemporaryDirectory(prefix="shardfit-serve-") as run_dir:
        cmd = [sys.executable, "-m", "shardfit", "serve", "--port=0", f"--logging.run_dir={run_dir}", *args]
        # The tiny model's matmuls are too small to gain from intra-op threads, and on a busy machine spinning
        # threads cost several times the step: one thread per rank unless the caller chose otherwise.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)  # its own group: torchrun's ranks stop with it
        lines: list[str] = []
        timer = threading.Timer(timeout_s, proc.kill)  # a server that never listens must not hang the example
        timer.start()
        url = None
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"listening on (http://\S+)", line):
                url = m.group(1)
                break
        timer.cancel()
        if url is None:
            proc.wait()
            raise RuntimeError(f"`{' '.join(cmd)}` did not start:\n{''.join(lines[-20:])}")
        # keep reading its output (a full pipe would block the server), and show it only if something fails
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        try:
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
