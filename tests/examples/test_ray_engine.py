"""examples/ray_engine.py: the Engine behind 2 Ray actors (CPU, gloo) against the same step in a 2-process
torch.multiprocessing group (tests/_dist.py), and a rank killed mid-step.

- the step's log-probs (forward and forward_backward), loss, gradient norm and the weights streamed to the driver
  after optim_step equal the 2-process run's;
- a rank whose process dies while its peer waits in a collective fails the step on the driver as one line naming
  the rank, within seconds, and the group is torn down (the survivor too); a new group that loads the last
  save_state then runs the next step exactly as the uninterrupted 2-process run did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES, SRC = ROOT / "examples", ROOT / "src"
OVERRIDES = ["--model.name=tiny", "--train.micro_batch_tokens=256"]
LR, BUCKET = 1e-3, 1 << 20  # 1 MiB buckets: the tiny model's 13 MiB of fp32 weights come in several


class _InProcess:
    """The group's call on a rank of the reference: the same EngineRank method, run here."""

    def __init__(self, rank):
        self.rank = rank

    def call(self, method, *args):
        return getattr(self.rank, method)(*args)


def _reference(rank, world, steps, out_dir):
    """The example's step on a rank of a 2-process gloo group; rank 0 writes each step's received weights."""
    sys.path.insert(0, str(EXAMPLES))
    import ray_engine
    from safetensors.torch import save_file

    worker = ray_engine.EngineRank()
    worker.start(rank, world, None, None, OVERRIDES, 300.0)  # the group exists: the Engine starts in it
    out = []
    for step in range(steps):
        receiver = ray_engine.ReceivedWeights()
        res = ray_engine.grpo_step(_InProcess(worker), ray_engine.given_rollouts(step), "ppo", LR, receiver,
                                   "float32", BUCKET)
        if rank == 0:
            save_file(receiver.tensors, os.path.join(out_dir, f"step{step}.safetensors"))
        out.append({k: [v.tolist() for v in res[k]] if k.endswith("logprobs") else res[k] for k in res})
    return out


@pytest.fixture(scope="module")
def example():
    """The example's module, and Ray on 2 CPUs whose workers import what the driver does (they inherit this
    environment: the sources and the examples on PYTHONPATH)."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(SRC), str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))
        import ray_engine

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            yield ray_engine
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Two steps of the 2-process run: per step its outputs and the weights rank 0 received."""
    from safetensors.torch import load_file

    from tests._dist import run_ranks

    out_dir = tmp_path_factory.mktemp("reference")
    steps = run_ranks(_reference, 2, 2, str(out_dir), timeout=300)[0]
    return [(s, load_file(out_dir / f"step{i}.safetensors")) for i, s in enumerate(steps)]


def _assert_equal(got: dict, weights: dict, expected):
    want, want_weights = expected
    for key in ("old_logprobs", "logprobs"):
        assert len(got[key]) == len(want[key]) == 16
        for g, w in zip(got[key], want[key]):
            np.testing.assert_array_equal(g, np.asarray(w, dtype=np.float32), err_msg=key)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"], (got, want)
    assert weights.keys() == want_weights.keys() and len(weights) == 38
    for name, t in weights.items():
        assert torch.equal(t, want_weights[name]), name


def test_the_ray_step_equals_a_two_process_run(example, reference):
    group = example.EngineGroup(2, OVERRIDES, start_timeout_s=300, call_timeout_s=300)
    try:
        assert {i["device"] for i in group.info} == {"cpu"} and len({i["pid"] for i in group.info}) == 2
        # bad input, refused alike by every rank before any collective: its own line, the group stays usable
        with pytest.raises(example.ShardfitError, match="^data: no data: the list of datums is empty") as bad:
            group.call("forward", [], "cross_entropy", {})
        assert not isinstance(bad.value, example.GroupFault)
        receiver = example.ReceivedWeights()
        out = example.grpo_step(group, example.given_rollouts(0), "ppo", LR, receiver, "float32", BUCKET)
        assert receiver.buckets > 3  # streamed: one actor call per bucket
        _assert_equal(out, receiver.tensors, reference[0])
        assert out["grad_norm"] > 0
    finally:
        group.shutdown()


@pytest.mark.slow  # ~11 s: the Ray fault path; the step's equality with a 2-process run stays in the default run
def test_a_killed_rank_is_one_line_and_a_new_group_resumes_exactly(example, reference, tmp_path):
    group = example.EngineGroup(2, OVERRIDES, start_timeout_s=300, call_timeout_s=300)
    example.grpo_step(group, example.given_rollouts(0), "ppo", LR, example.ReceivedWeights(), "float32", BUCKET)
    saved = group.call("save_state", str(tmp_path / "state"))
    # Rank 1 is stopped, then killed 2 s into the next step: rank 0 waits for it in the step's first collective.
    pid = group.info[1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(2.0, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(example.GroupFault) as caught:
        example.grpo_step(group, example.given_rollouts(1), "ppo", LR, example.ReceivedWeights(), "float32", BUCKET)
    elapsed = time.monotonic() - t0
    line = str(caught.value)
    assert elapsed < 60, elapsed
    assert "\n" not in line and caught.value.ranks == [1], line
    assert line.startswith(f"Ray actor of rank 1 (pid {pid} on ") and "rank 1 died during forward" in line, line
    with pytest.raises(example.ray.exceptions.RayActorError):  # the survivor was killed too, not left waiting
        example.ray.get(group.actors[0].address.remote(), timeout=60)
    with pytest.raises(example.ShardfitError, match="shut down"):
        group.call("forward", [])

    group = example.EngineGroup(2, OVERRIDES, start_timeout_s=300, call_timeout_s=300)
    try:
        assert group.call("load_state", saved) == 1
        receiver = example.ReceivedWeights()
        out = example.grpo_step(group, example.given_rollouts(1), "ppo", LR, receiver, "float32", BUCKET)
        _assert_equal(out, receiver.tensors, reference[1])
    finally:
        group.shutdown()


def test_without_ray_the_example_says_how_to_install_it():
    hide_ray = ("import runpy, sys; sys.modules['ray'] = None; sys.argv = ['ray_engine.py']; "
                f"runpy.run_path({str(EXAMPLES / 'ray_engine.py')!r}, run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", hide_ray], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "examples/ray_engine.py needs Ray: pip install 'shardfit[ray]'\n" and not done.stdout
