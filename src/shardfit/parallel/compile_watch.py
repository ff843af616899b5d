"""torch.compile's silent eager fallback, made visible: the functions dynamo gave up on in this process.

Dynamo keeps at most torch._dynamo.config.recompile_limit (8) compiled variants of one code object (and
accumulated_recompile_limit of them in all, where torch has one). A call that needs one more variant is not compiled:
dynamo logs one warning, "torch._dynamo hit config.recompile_limit (8)", from logger torch._dynamo.convert_frame, and
from then on every call that matches none of the variants runs eager, with no further word. A run whose blocks fell
back this way was much slower and said so only in a server's stderr (benchmarks/README.md, issue 35's section).

torch offers no public hook for this event, so the warning itself is the signal: a logging.Handler on the
torch._dynamo logger (the registered parent: its children propagate to it, and it does not propagate to "torch";
torch._logging's resets remove only the handlers it made itself). The message has one shape in every torch read for
it (the old cache_size_limit releases through 2.13 and main): "torch._dynamo hit config.<limit> (<value>)\\n
function: '<name>' (<file>:<line>)\\n   last reason: <text>", the limit named recompile_limit or
accumulated_recompile_limit (cache_size_limit in older releases). A warning of that first line whose details do not
parse still counts, with the message's first line as its reason: the count stays right where torch rewords the rest.

Cost: nothing per step; the handler runs only when dynamo logs a warning (compile time). Readers (the trainer after
each step, serve after each request, StepRecord.compile_fallbacks) read the length of a list. logging.Handler.handle
holds the handler's lock around emit, so serve's worker thread and the main thread record and read safely.
Caveat: dynamo's caches are per process, so is this list; each rank watches its own (every rank runs the same code,
so they fall back alike), and a TORCH_LOGS that silences dynamo's warnings silences this too.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass

MARKER = "compile fallback"  # every line told starts with it (benchmarks count it in a server's log)
_PREFIX = "torch._dynamo hit config."
_HIT = re.compile(r"torch\._dynamo hit config\.(?P<limit>\w+) \((?P<value>[^)\n]*)\)\s*\n\s*function: "
                  r"'(?P<name>[^'\n]*)' \((?P<where>[^\n]*)\)\s*\n\s*last reason: (?P<reason>[^\n]*)")
_REASON_CHARS = 200  # a guard's text can quote a long expression; the line stays one readable line


@dataclass(frozen=True)
class CompileFallback:
    """One function dynamo gave up on: its code name, file:line, the limit it hit and the last recompile reason."""

    function: str
    where: str
    limit: str  # the config name: recompile_limit, accumulated_recompile_limit (cache_size_limit in older torch)
    value: str  # the limit's value when it was hit
    reason: str

    def line(self) -> str:
        """The one line told to the user: what ran eager, why, and what to do."""
        return (f"{MARKER}: torch.compile gave up on '{self.function}' ({self.where}) at "
                f"torch._dynamo.config.{self.limit}={self.value}: its calls that match none of its compiled variants "
                f"now run eager (slower; last recompile reason: {self.reason}); fix: report it with "
                f"TORCH_LOGS=recompiles output; or raise torch._dynamo.config.{self.limit}")


def parse_limit_hit(message: str) -> CompileFallback | None:
    """The fallback a dynamo warning reports, or None for any other warning."""
    if not message.startswith(_PREFIX):
        return None
    m = _HIT.match(message)
    if m is None:  # reworded details: still a fallback, told with what the first line says
        first = message.splitlines()[0]
        return CompileFallback("?", "?", first[len(_PREFIX):].split(" ")[0] or "?", "?", first)
    # a guard failure reads "0/0: n == 0   # <the source line> # <file>:<line> in <function>": the guard alone
    reason = re.split(r"\s{2,}#", m["reason"])[0].strip()
    if len(reason) > _REASON_CHARS:
        reason = reason[:_REASON_CHARS] + "..."
    return CompileFallback(m["name"], m["where"], m["limit"], m["value"], reason or "?")


class CompileWatch(logging.Handler):
    """The fallbacks recorded from dynamo's warnings, each function once (by name and file:line)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.fallbacks: list[CompileFallback] = []  # appended only: a reader's place in it stays valid

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # the template first (cheap): every other dynamo warning passes through here too
            if not (isinstance(record.msg, str) and record.msg.startswith(_PREFIX)):
                return
            hit = parse_limit_hit(record.getMessage())
            if hit is not None and all((f.function, f.where) != (hit.function, hit.where) for f in self.fallbacks):
                self.fallbacks.append(hit)
        except Exception:  # noqa: BLE001 - a logging handler must not break the compile that logged
            self.handleError(record)


_WATCH = CompileWatch()
_INSTALL = threading.Lock()


def watch_compile() -> None:
    """Start watching dynamo's warnings in this process (apply_compile calls it; once is enough, again is a no-op)."""
    with _INSTALL:
        log = logging.getLogger("torch._dynamo")
        if _WATCH not in log.handlers:
            log.addHandler(_WATCH)


def compile_fallbacks() -> list[CompileFallback]:
    """Every function torch.compile gave up on in this process so far (empty where nothing is watched)."""
    return list(_WATCH.fallbacks)


def fallback_count() -> int:
    """How many functions torch.compile gave up on in this process so far: 0 means every compiled call compiled."""
    return len(_WATCH.fallbacks)


class FallbackNotes:
    """One reader's place in the process's fallbacks: new() returns the lines of those not yet told to it, so each
    reader (the trainer's log, serve's log) tells each function once."""

    def __init__(self):
        self.told = 0

    def new(self) -> list[str]:
        fresh = _WATCH.fallbacks[self.told:]
        self.told += len(fresh)
        return [f.line() for f in fresh]
