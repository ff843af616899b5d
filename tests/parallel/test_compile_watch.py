"""torch.compile's eager fallback past recompile_limit is told (parallel/compile_watch.py): the warning's parse, one
line per function, and through the trainer (its log and metrics.jsonl) with the limit lowered to force it.

Dynamo's caches, its config and the watch's list are per process: every case that compiles runs in a rank of its own
(tests/_dist.py), so a lowered limit never reaches another test."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

from shardfit.parallel.compile_watch import MARKER, CompileWatch, parse_limit_hit
from tests._dist import run_ranks
from tests.helpers import small_config

# torch 2.13's warning, word for word (convert_frame.py), a guard failure as its last reason
NEW = ("torch._dynamo hit config.recompile_limit (8)\n   function: 'forward' (/x/shardfit/models/decoder.py:120)\n"
       "   last reason: 0/7: ___check_obj_id(L['self'], 1403)          # return self.mlp(x)  # decoder.py:121 in "
       "forward\nUser stack trace:\n  File \"decoder.py\", line 121\nTo log all recompilation reasons, use "
       "TORCH_LOGS=\"recompiles\".\nTo diagnose recompilation issues, see https://pytorch.org/x")
# the older releases' (cache_size_limit, a period after the URL)
OLD = ("torch._dynamo hit config.cache_size_limit (8)\n   function: 'fn' (/a/b.py:3)\n   last reason: tensor 'L['x']' "
       "size mismatch at index 0. expected 4, actual 5\nTo log all recompilation reasons, use "
       "TORCH_LOGS=\"recompiles\".\nTo diagnose recompilation issues, see https://pytorch.org/x.")


def test_the_warning_of_each_torch_parses():
    new = parse_limit_hit(NEW)
    assert (new.function, new.where, new.limit, new.value) == ("forward", "/x/shardfit/models/decoder.py:120",
                                                               "recompile_limit", "8")
    assert new.reason == "0/7: ___check_obj_id(L['self'], 1403)"  # the guard, without its source comment
    old = parse_limit_hit(OLD)
    assert (old.function, old.limit) == ("fn", "cache_size_limit")
    assert old.reason == "tensor 'L['x']' size mismatch at index 0. expected 4, actual 5"
    acc = parse_limit_hit(NEW.replace("config.recompile_limit (8)", "config.accumulated_recompile_limit (256)"))
    assert (acc.limit, acc.value) == ("accumulated_recompile_limit", "256")
    # reworded details still count; any other warning does not
    odd = parse_limit_hit("torch._dynamo hit config.recompile_limit (8) for 'f'")
    assert odd is not None and odd.function == "?" and odd.limit == "recompile_limit"
    assert parse_limit_hit("Graph break: skip: from user code") is None


def test_the_line_names_the_function_the_reason_and_the_fix():
    line = parse_limit_hit(NEW).line()
    assert "\n" not in line and line.startswith(MARKER)
    assert "'forward' (/x/shardfit/models/decoder.py:120)" in line and "___check_obj_id" in line
    assert line.endswith("fix: report it with TORCH_LOGS=recompiles output; or raise "
                         "torch._dynamo.config.recompile_limit")


def test_each_function_is_recorded_once():
    watch = CompileWatch()  # an instance of its own: the process's list is left alone

    def warn(msg: str) -> None:
        watch.handle(logging.LogRecord("torch._dynamo.convert_frame", logging.WARNING, "", 0, msg, None, None))

    warn(NEW)
    warn(NEW.replace("(8)", "(9)"))  # the same function again
    warn("some other dynamo warning")
    warn(OLD)
    assert [f.function for f in watch.fallbacks] == ["forward", "fn"]


# --- real dynamo --------------------------------------------------------------------------------------------------
def _dynamo(rank, world, limit: int):
    import torch

    from shardfit.parallel.compile_watch import FallbackNotes, compile_fallbacks, watch_compile

    torch._dynamo.config.recompile_limit = limit
    watch_compile()
    watch_compile()  # again: still one handler, each fallback recorded once

    @torch.compile(backend="eager")  # dynamo's own decision; no inductor needed for it
    def scale(x, n):
        return x * n

    notes = FallbackNotes()
    told = []
    for n in range(4):  # a python int is a guard: each new n is one more variant
        scale(torch.ones(2), n)
        told += notes.new()
    return {"fallbacks": [(f.function, f.where, f.limit) for f in compile_fallbacks()], "told": told}


def test_dynamo_past_its_limit_is_recorded_once_and_told_once():
    out = run_ranks(_dynamo, 1, 1)[0]
    assert len(out["fallbacks"]) == 1, out
    function, where, limit = out["fallbacks"][0]
    assert function == "scale" and where.startswith(__file__) and limit == "recompile_limit"
    assert len(out["told"]) == 1 and "'scale'" in out["told"][0], out  # three calls past the limit, one line


def test_dynamo_within_its_limit_records_nothing():
    out = run_ranks(_dynamo, 1, 8)[0]
    assert out == {"fallbacks": [], "told": []}


# --- through the trainer ------------------------------------------------------------------------------------------
def _train(rank, world, run_dir: str):
    """A compiled LoRA run as it is, then one with recompile_limit=1: block 0's input takes no gradient (a frozen
    embedding) and block 1's does, so the blocks' one forward needs a second variant, past that limit."""
    import torch

    from shardfit.train import Trainer

    out = {}
    for name, limit in (("normal", 8), ("forced", 1)):
        torch._dynamo.reset()  # the first run's variants must not serve the second
        torch._dynamo.config.recompile_limit = limit
        cfg = small_config("--compute.compile=true", "--compute.compile_loss=false", "--lora.rank=4",
                           "--train.steps=2", "--logging.progress=lines", run_dir=f"{run_dir}/{name}")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            Trainer(cfg).fit()
        records = [json.loads(x) for x in Path(run_dir, name, "metrics.jsonl").read_text().splitlines()]
        out[name] = {"lines": [x for x in printed.getvalue().splitlines() if f"{MARKER}:" in x],
                     "counts": [r["compile_fallbacks"] for r in records if r.get("kind") == "train"],
                     "log": [x for x in printed.getvalue().splitlines() if x.startswith("step 2/2")]}
    return out


def test_the_trainer_tells_a_fallback_once_and_counts_it(tmp_path):
    out = run_ranks(_train, 1, str(tmp_path))[0]
    normal, forced = out["normal"], out["forced"]
    assert normal["lines"] == [] and normal["counts"] == [0, 0], normal
    assert len(forced["lines"]) == 1, forced
    line = forced["lines"][0]
    assert line.startswith(f"step 1: {MARKER}: torch.compile gave up on 'forward' (") and "decoder" in line, line
    assert "recompile_limit=1" in line and "fix: report it with TORCH_LOGS=recompiles output" in line
    assert forced["counts"] == [1, 1], forced  # metrics.jsonl: every step's record carries the count
    assert "compile fallbacks 1" in forced["log"][0]  # and the step's log line


# --- through serve's command loop ---------------------------------------------------------------------------------
def _serve(rank, world):
    """serve's loop (serve/commands.py) on one rank, its commands calling a compiled function with a new python int
    each (a new variant each) under recompile_limit=1: its log, line by line."""
    import threading

    import torch

    from shardfit.parallel.compile_watch import watch_compile
    from shardfit.serve.commands import Command, Loop
    from shardfit.serve.futures import FutureStore, Result
    from shardfit.serve.ordering import Scheduler

    torch._dynamo.config.recompile_limit = 1
    watch_compile()  # as apply_compile does in the server's Engine
    scale = torch.compile(lambda x, n: x * n, backend="eager")

    def execute(cmd):
        return Result(json={"y": float(scale(torch.ones(1), cmd.args["n"]))}), {}

    sched, futures, log = Scheduler(), FutureStore(), []
    for n in range(4):
        sched.submit(Command("work", futures.create("work"), {"n": n}))
    threading.Timer(1.5, sched.close).start()
    Loop(execute, rank, world, torch.device("cpu"), sched, futures, idle_s=0.2, log=log.append).run()
    return log


def test_serve_logs_a_fallback_once_after_the_request_that_met_it():
    log = run_ranks(_serve, 1)[0]
    requests = [i for i, x in enumerate(log) if x.startswith("shardfit serve: work ")]
    told = [i for i, x in enumerate(log) if x.startswith(f"shardfit serve: {MARKER}: ")]
    assert len(requests) == 4 and len(told) == 1, log
    assert told[0] == requests[1] + 1, log  # the second request needed a second variant: past the limit of 1
    assert "'<lambda>'" in log[told[0]] and "raise torch._dynamo.config.recompile_limit" in log[told[0]]
