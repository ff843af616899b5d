"""A sample run on two gloo ranks whose decode step fails on rank 1 only (serve/sample_joining.py, the real Engine,
`--lora.rank=8`, CPU, loopback): rank 1 still joins the chunk's exchange, so both ranks leave the run from it (rank
0 with engine/sample_results.py's RankFailed): the request fails with one server-error line, no rank is left
waiting in a collective, and the next sample and a training step run in step as if nothing had happened.
"""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")

from tests._dist import run_ranks  # noqa: E402
from tests.serve.engine_server import error, serve, steps  # noqa: E402
from tests.serve.test_sample_joining import ARGS, _send, _seqs  # noqa: E402


def _failing_once() -> None:
    """SampleRun.step raising once, at its first call (an out-of-memory of this rank alone, say)."""
    from shardfit.engine.sample_run import SampleRun

    inner, calls = SampleRun.step, []

    def step(self, steps=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (a test)")
        return inner(self, steps)

    SampleRun.step = step


def _scenario(sc, url: str, base_model: str) -> dict:
    tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=1).result()
    live = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    out = {"failed": error(lambda: _send(live, [1, 2, 3], 5, 1).result())}  # decodes on rank 0: rank 1's share empty
    out["next"] = _seqs(_send(live, [1, 2, 3], 5, 1).result())
    out["loss"] = steps(tc, [1])
    return out


def _serve(rank: int, world: int, run_dir: str):
    if rank == 1:
        _failing_once()
    return serve(rank, world, run_dir, _scenario, ARGS)


def test_a_step_failing_on_one_rank_fails_the_run_on_both_and_the_server_goes_on(tmp_path):
    got = run_ranks(_serve, 2, str(tmp_path / "run"), timeout=300)[0]
    assert "RankFailed" in got["failed"] and "rank(s) [1] failed" in got["failed"], got["failed"]
    assert "a server bug" in got["failed"] and "\n" not in got["failed"].strip()
    assert [len(t) for t, _ in got["next"]] == [5]
    assert len(got["loss"]) == 1
