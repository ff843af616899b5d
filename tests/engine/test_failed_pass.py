"""A forward_backward that fails midway (engine/engine.py, engine/update.py): the micro-batches it ran before the
failure had already added to the gradients; the next optim_step refuses in one line and takes no step, and a clean
step afterwards equals one that never saw the failure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import SMALL

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir="]


def _datums(seed=0, n=6):
    from shardfit.rl import make_datum

    rng = np.random.default_rng(seed)
    out = []
    for L in rng.integers(10, 30, n):
        seq = rng.integers(0, 256, L + 1)
        out.append(make_datum(seq[:-1], target_tokens=seq[1:], weights=np.ones(L)))
    return out


def _weights(engine):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in engine.model.state_dict().items()}


def test_optim_step_after_a_failed_pass_refuses_and_a_clean_step_is_unaffected():
    from shardfit.config import load_config
    from shardfit.errors import ShardfitError
    from shardfit.rl import AdamParams, DatumEngine

    calls = {"n": 0}

    def breaks_on_the_second_micro_batch(logp, x, cfg):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("the loss broke")
        return -logp

    data, other = _datums(0), _datums(1)
    adam = AdamParams(learning_rate=1e-2)
    clean = DatumEngine.start(load_config(None, ARGS))
    clean.forward_backward(data, "cross_entropy")
    clean.optim_step(adam)
    want = _weights(clean)

    engine = DatumEngine.start(load_config(None, ARGS))
    before = _weights(engine)
    engine.forward_backward(other, "cross_entropy")  # a call of the step that succeeded, then one that fails
    with pytest.raises(ValueError, match="the loss broke"):
        engine.forward_backward(data, breaks_on_the_second_micro_batch)
    assert calls["n"] == 2  # the failure came after a micro-batch's backward
    with pytest.raises(ShardfitError, match=r"a forward_backward since the last optim_step failed \(the loss broke\)"
                       ) as e:
        engine.optim_step(adam)
    assert e.value.where == "optim_step" and "send this step's forward_backward calls again" in str(e.value)
    for k, v in _weights(engine).items():  # no step was taken
        assert torch.equal(v, before[k]), k
    engine.forward_backward(data, "cross_entropy")  # the step sent again: as if nothing had failed
    engine.optim_step(adam)
    for k, v in _weights(engine).items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
