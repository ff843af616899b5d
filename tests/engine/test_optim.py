import math

import pytest

from shardfit.config import load_config
from shardfit.engine.optim import AdamParams, check_adam, lr_at
from shardfit.errors import ShardfitError


def test_warmup_then_cosine_to_floor():
    cfg = load_config(None, ["--train.lr=1.0", "--train.warmup_steps=10", "--train.steps=110",
                             "--train.min_lr_ratio=0.1"]).train
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert lr_at(10, cfg) == 1.0
    assert math.isclose(lr_at(60, cfg), 0.55)
    assert math.isclose(lr_at(110, cfg), 0.1) and math.isclose(lr_at(500, cfg), 0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 120))


def test_an_eps_of_0_is_refused():
    """Adam steps by m / (sqrt(v) + eps): with eps 0 a zero gradient (LoRA's A at the first step) is 0 / 0, NaN
    weights that no later step repairs."""
    for eps in (0.0, 1e-46):  # 1e-46 is 0 in float32, Adam's state
        with pytest.raises(ShardfitError, match="eps=") as e:
            check_adam(AdamParams(1e-3, eps=eps))
        assert e.value.where == "adam_params.eps"
    check_adam(AdamParams(1e-3, eps=1e-12))
