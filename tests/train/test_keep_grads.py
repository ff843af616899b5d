"""memory.keep_grads: the sharded gradients stay allocated (the same storage, zeroed) from step to step."""

import pytest

from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import small_config


def _grads_across_steps(rank, world, keep, run_dir):
    trainer = Trainer(small_config(f"--memory.keep_grads={keep}", run_dir=run_dir))
    out = []
    for _ in range(2):
        trainer.train_step()
        grads = [p.grad for p in trainer.engine.params]
        out.append({"none": sum(g is None for g in grads),
                    "ptrs": [g.to_local().data_ptr() for g in grads if g is not None],
                    "zero": all(bool((g.to_local() == 0).all()) for g in grads if g is not None)})
    return out


@pytest.mark.parametrize("keep", [True, False])
def test_gradients_kept_or_freed_between_steps(tmp_path, keep):
    for steps in run_ranks(_grads_across_steps, 2, keep, str(tmp_path)):
        if keep:
            assert steps[0]["none"] == 0 and steps[0]["zero"]
            assert steps[0]["ptrs"] == steps[1]["ptrs"]  # the same buffers, reused
        else:
            assert all(s["none"] == len(s["ptrs"]) + s["none"] and not s["ptrs"] for s in steps)
