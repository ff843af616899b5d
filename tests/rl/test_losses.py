"""resolve_loss: every wrong loss_fn_config value is one ShardfitError naming loss_fn_config.KEY (a client's
mistake, which the server reports as category user or a 400), never a ValueError from deep inside."""

import pytest

from shardfit.errors import ShardfitError
from shardfit.rl.losses import resolve_loss


@pytest.mark.parametrize("loss, config, where", [
    ("ppo", {"clip_low_threshold": "high"}, "loss_fn_config.clip_low_threshold"),
    ("ppo", {"dual_clip": None}, "loss_fn_config.dual_clip"),
    ("ppo", {"clip_low_threshold": 1.5, "clip_high_threshold": 0.5}, "loss_fn_config.clip_low_threshold"),
    ("ppo", {"clip_low_threshold": 0.2, "clip_high_threshold": 0.28}, "loss_fn_config.clip_low_threshold"),
    ("cross_entropy", {"kl_coef": [1]}, "loss_fn_config.kl_coef"),
    ("cross_entropy", {"entropy_coef": float("inf")}, "loss_fn_config.entropy_coef"),
    ("cross_entropy", {"normalize": "constant", "normalize_constant": {"x": 1}}, "loss_fn_config.normalize_constant"),
    ("cross_entropy", {"normalize_constant": True}, "loss_fn_config.normalize_constant"),
    ("cross_entropy", {"normalize": 3.0}, "loss_fn_config.normalize"),
    ("cross_entropy", {"logprobs_at": "response"}, "loss_fn_config.logprobs_at"),
    ("cross_entropy", {"clip": 0.2}, "loss_fn_config"),
    ("nope", {}, "loss_fn"),
    (["cross_entropy"], {}, "loss_fn"),
])
def test_each_wrong_option_names_its_key(loss, config, where):
    with pytest.raises(ShardfitError) as e:
        resolve_loss(loss, config)
    assert e.value.where == where and e.value.fix and "\n" not in str(e.value)


def test_numbers_are_read_as_floats():
    spec = resolve_loss("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": "1.5", "kl_coef": 1,
                                "normalize": "token_mean"})
    assert spec.config == {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    assert spec.kl_coef == 1.0 and spec.normalize == "token_mean" and "ref_logprobs" in spec.required
