"""The one place where an exception escaping a command becomes the request's answer (commands.Loop.step), on every
rank alike, so that the loop, the server and every model go on:

- a full disk (fsutil.full_disk anywhere in the exception's chain, or the Engine's own DiskFull): category server,
  naming the directory and the space needed; nothing is listed from the failed save, the previous checkpoint is
  untouched, and the same save works once space is freed;
- a ShardfitError (bad input only the Engine could tell, raised on every rank alike): category user, its line;
- anything else, BaseException subclasses included (DCP's CheckpointException is not an Exception): a server bug,
  its traceback printed once on rank 0, category server.
KeyboardInterrupt and SystemExit are not caught here: they end the process.
"""

from __future__ import annotations

import traceback

from shardfit.errors import DiskFull, ShardfitError
from shardfit.fsutil import full_disk_error
from shardfit.serve.futures import Result

SPACE_FIX = "free space there: the server and its models keep running, and the same request works once it is freed"


def _what(cmd) -> str:
    path = cmd.args.get("tinker_path") if isinstance(cmd.args, dict) else None
    return f"checkpoint {path}" if path else f"the {cmd.kind} request's files"


def failure_result(e: BaseException, cmd, rank: int, needed: int | None = None) -> Result:
    """The Result of command `cmd` that raised `e`; needed: the bytes its writes take (a save), when known."""
    if isinstance(e, DiskFull):  # the Engine's checkpoint writer named it (every rank agreed)
        return Result(error=str(ShardfitError(e.what, where=e.where, fix=SPACE_FIX)), category="server")
    directory = cmd.args.get("dir", "") if isinstance(cmd.args, dict) else ""
    disk = full_disk_error(e, directory, _what(cmd), SPACE_FIX, needed)
    if disk is not None:
        return Result(error=str(disk), category="server")
    if isinstance(e, ShardfitError):
        return Result(error=str(e), category="user")
    if rank == 0:  # a bug: said once with its traceback, the request failed, the loop goes on
        traceback.print_exception(type(e), e, e.__traceback__)
    said = (str(e).strip().splitlines() or [""])[0][:300]
    return Result(error=f"{type(e).__name__}: {said} (a server bug: see the server's log)", category="server")
