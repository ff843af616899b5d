"""FLOPs per token: the anchors' formula, with tied and untied heads counted alike."""

import torch

from shardfit.config import load_config
from shardfit.models import build_model, count_params
from shardfit.train.metrics import flops_per_token


def test_tied_and_untied_models_do_the_same_work():
    out = {}
    for tied in (True, False):
        cfg = load_config(None, ["--model.name=llama3-1b", f"--model.tie_embeddings={tied}"]).model
        with torch.device("meta"):
            n = count_params(build_model(cfg))
        out[tied] = flops_per_token(cfg, n, 4096)
    assert out[True] == out[False]
    # the untied Llama-3.2-1B shape: 6 x (1.498e9 - 0.263e9 embedding) + 12 x 16 x 2048 x 4096
    assert abs(out[False] - (6 * (1_498_482_688 - 128256 * 2048) + 12 * 16 * 2048 * 4096)) < 1
