"""`shardfit serve` as a benchmark's child: started in a session of its own, its URL read from its log, and stopped
with its whole process group however the benchmark ends (an exception, SIGTERM from a stage's `timeout`: the caller
turns it into SystemExit, and the `finally` here still runs). Used by bench_rl.py's serve part and bench_clients.py.

    with running_server(cmd, cap_start=180, cwd=ROOT, env=env) as srv:
        if srv.url: ... drive it ...
    srv.start_s, srv.error, srv.log_tail()   # after the block: the server is gone
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Server:
    url: str = ""  # "" until its "listening on" line came (or never: then error says why)
    start_s: float = 0.0  # seconds from the launch to that line (or to giving up)
    error: str = ""
    log: list[str] = field(default_factory=list)

    def log_tail(self, lines: int = 6, chars: int = 800) -> str:
        return "".join(self.log[-lines:])[-chars:]


@contextlib.contextmanager
def running_server(cmd: list[str], cap_start: float, cwd, env: dict) -> Iterator[Server]:
    """Run `cmd` (a `shardfit serve --port=0 ...` command line) until its "listening on URL" line or cap_start
    seconds; yield the Server (url empty when it did not come up: error holds its last lines); on leaving, SIGTERM
    to its process group (serve stops after the command in hand), SIGKILL after 30 s."""
    srv = Server()
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
                         start_new_session=True)
    found = threading.Event()

    def read():
        for line in p.stdout:
            srv.log.append(line)
            if not found.is_set() and (m := re.search(r"listening on (http://\S+)", line)):
                srv.url = m.group(1)
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not found.is_set() and p.poll() is None and time.time() - t0 < cap_start:
            found.wait(0.5)
        srv.start_s = round(time.time() - t0, 1)
        if not srv.url:
            if p.poll() is not None:  # it ended: its last lines are still on their way through the reader
                reader.join(5)
            srv.error = "no 'listening on' line: " + "".join(srv.log[-8:])[-600:]
        yield srv
    finally:  # the server and its CUDA context go before the next part (or on SIGTERM): its whole session, its
        # children too (a compile worker holds GPU memory): waited for, not only the leader, SIGKILL after 30 s
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        if not _group_ended(p, 30):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            _group_ended(p, 30)
        reader.join(5)


def _group_ended(p: subprocess.Popen, timeout: float) -> bool:
    """Whether the leader p and every other live process of its group (pgid p.pid) end within `timeout` seconds.
    A member is live while /proc shows it in the group and not a zombie (an orphan's zombie may never be reaped
    where PID 1 does not reap: it holds nothing)."""
    t_end = time.time() + timeout
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    while _group_members(p.pid):
        if time.time() > t_end:
            return False
        time.sleep(0.05)
    return True


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group `pgid`, from /proc (Linux; elsewhere none are seen)."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()  # after the command's name: state, ppid, pgrp
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out
