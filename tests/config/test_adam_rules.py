"""The Adam hyperparameter rule that serve (a request) and the Engine (an in-process caller) both apply."""

import pytest

from shardfit.config.adam_rules import ADAM_DEFAULTS, adam_values
from shardfit.engine.optim import AdamParams, check_adam
from shardfit.errors import ShardfitError
from shardfit.serve.schemas import OptimStepBody, adam_args

BAD = [({"learning_rate": -1}, "learning_rate", "is not a finite number >= 0"),
       ({"eps": float("nan")}, "eps", "is not a finite number >= 0"),
       ({"weight_decay": True}, "weight_decay", "is not a finite number >= 0"),
       ({"beta2": 1.0}, "beta2", "must be below 1"),
       ({"eps": 0.0}, "eps", "divides by zero"),
       ({"eps": 1e-46}, "eps", "divides by zero")]  # 0 in float32, Adam's state


@pytest.mark.parametrize("given,key,said", BAD)
def test_serve_and_the_engine_refuse_the_same_value_naming_its_key(given, key, said):
    with pytest.raises(ShardfitError, match=said) as served:
        adam_args(OptimStepBody(model_id="m", seq_id=1, adam_params=given))
    assert served.value.where == f"/optim_step adam_params.{key}"
    with pytest.raises(ShardfitError, match=said) as in_process:
        check_adam(AdamParams(**{**ADAM_DEFAULTS, **given}))
    assert in_process.value.where == f"adam_params.{key}"
    assert str(served.value) == str(in_process.value).replace("adam_params.", "/optim_step adam_params.")


def test_missing_values_take_tinkers_defaults_and_the_dataclass_agrees():
    assert adam_values({"learning_rate": 3e-4}, "x") == {**ADAM_DEFAULTS, "learning_rate": 3e-4}
    assert vars(AdamParams()) == ADAM_DEFAULTS
