import os

import pytest
import torch

# Two ranks share CI's two cores: one thread each keeps them from fighting.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    """A run directory with checkpoints of steps 1 and 2 that two gloo ranks wrote (small_config): what model.init_from
    and shardfit export read in another layout."""
    from tests._dist import run_ranks
    from tests.helpers import train_small

    run = tmp_path_factory.mktemp("two_rank") / "run"
    run_ranks(train_small, 2, str(run), "--train.steps=2", "--checkpoint.every=1", "--checkpoint.final=true")
    return run
