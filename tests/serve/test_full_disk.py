"""A full disk during save_state, through the official SDK: that request fails at once (category server, not
retried) naming the directory and the space needed; the server and its model live on, the previous checkpoint is
intact and listed alone, and the same save works once space is freed. The server runs in a process of its own on
tests/_disk.py's small disk (a tmpfs, else RLIMIT_FSIZE changed with prlimit)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
from tinker import types  # noqa: E402

from tests._disk import small_disk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server_on_small_disk(tmp_path):
    with small_disk(tmp_path / "disk", 256 << 20) as disk:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, str(ROOT)]), "TINKER_TELEMETRY": "0",
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "tests.serve.fake_server", str(disk.path / "run")], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                preexec_fn=disk.preexec())
        url = None
        for line in proc.stdout:
            if m := re.search(r"listening on (http://\S+)", line):
                url = m.group(1)
                break
        assert url, "the server did not start"
        try:
            yield url, disk, proc
        finally:
            proc.terminate()
            proc.wait(30)


def _data() -> list[types.Datum]:
    t = list(b"a full disk must not cost the model")
    return [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(t[1:], np.int64)})]


def test_a_full_disk_fails_that_save_alone(server_on_small_disk, sdk_client):
    url, disk, proc = server_on_small_disk
    sc = sdk_client(url, "tml-test")
    tc = sc.create_lora_training_client(base_model="tiny", rank=0).result()
    tc.forward_backward(_data(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    first = tc.save_state("first").result().path
    disk.fill(proc.pid)
    t0 = time.monotonic()
    with pytest.raises(tinker.RequestFailedError) as e:
        tc.save_state("second").result()
    assert time.monotonic() - t0 < 30  # answered, not retried
    run = disk.path / "run" / "checkpoints" / tc.model_id / "weights"
    assert e.value.category == "server"
    msg = str(e.value)
    assert f"{run / 'second'}: could not write checkpoint tinker://{tc.model_id}/weights/second: the disk is full" in \
        msg and "it needs about " in msg and "fix: free space there" in msg, msg
    loss = tc.forward(_data(), "cross_entropy").result().metrics["loss:sum"]  # the model lives on
    listed = [c["checkpoint_id"] for c in httpx.get(f"{url}/api/v1/training_runs/{tc.model_id}/checkpoints",
                                                     headers={"X-API-Key": "tml-test"}).json()["checkpoints"]]
    assert listed == ["weights/first"] and not (run / "second" / "state.pt").exists()
    disk.free(proc.pid)
    second = tc.save_state("second").result().path
    for path in (first, second):  # both whole: each loads, and gives the weights as they were saved
        resumed = sc.create_training_client_from_state(path).result()
        assert resumed.forward(_data(), "cross_entropy").result().metrics["loss:sum"] == pytest.approx(loss)


def _raising(exc: BaseException):
    def save_state(path, optimizer=True):
        raise exc
    return save_state


def _in_context(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__context__ = inner
    return outer


def test_whatever_a_save_raises_is_that_requests_answer(served):
    """The one place (commands.failure_result), for each kind of exception a save can raise, BaseException included
    (DCP's CheckpointException is not an Exception: it used to pass the loop's handler and end the server)."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from shardfit.errors import DiskFull, ShardfitError
    from tests.serve.raw_http import KEY, Client

    c = Client(served.url)
    loss = c.good_forward()
    enospc = _in_context(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                         OSError(errno.ENOSPC, "No space left on device"))
    cases = {
        "DCP around a full disk": (CheckpointException("ranks:[0]", {0: (enospc, None)}), "server",
                                   "the disk is full (No space left on device); it needs about "),
        "the Engine's DiskFull": (DiskFull("could not write checkpoint step_1 on rank 1: the disk is full", where="/x",
                                           fix="then resume"), "server", "/x: could not write checkpoint step_1"),
        "DCP around something else": (CheckpointException("ranks:[0]", {0: (RuntimeError("odd"), None)}), "server",
                                      "CheckpointException ranks:dict_keys([0]) (a server bug: see the server's log)"),
        "bad input only the Engine tells": (ShardfitError("no", where="w", fix="f"), "user", "w: no; fix: f"),
    }
    real = served.engine.save_state
    try:
        for name, (exc, category, needle) in cases.items():
            served.engine.save_state = _raising(exc)
            r = c.http.post("/save_weights", headers=KEY, json={"model_id": c.model_id, "seq_id": c.next_seq(),
                                                                 "path": f"n{len(name)}"})
            out = c.result(r.json()["request_id"])
            assert out["category"] == category and needle in out["error"], (name, out)
            if category == "server" and "bug" not in needle:
                assert "fix: free space there: the server and its models keep running" in out["error"], out
            assert c.good_forward() == pytest.approx(loss), name  # the loop, and the model, went on
    finally:
        served.engine.save_state = real
    listed = c.http.get(f"/training_runs/{c.model_id}/checkpoints", headers=KEY).json()["checkpoints"]
    assert listed == []  # no failed save is listed
