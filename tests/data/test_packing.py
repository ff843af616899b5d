import numpy as np
import pytest

from shardfit.data import PackedDataset
from shardfit.errors import ShardfitError


def _ds(n_tokens=1000, seq=16, seed=3):
    return PackedDataset(np.arange(n_tokens, dtype=np.uint32), seq, seed)


def test_windows_cover_stream_and_labels_shift():
    ds = _ds()
    assert ds.num_windows == (1000 - 1) // 16
    mb = ds.step_batches(0, 8, 8, 0, 1)[0]
    assert (mb.labels[:, :-1] == mb.input_ids[:, 1:]).all()
    assert ((mb.input_ids[:, 0] % 16) == 0).all()  # windows start on multiples of seq_len


@pytest.mark.parametrize("world, micro", [(1, 8), (2, 4), (2, 2), (4, 1)])
def test_ranks_and_micro_batches_partition_the_global_batch(world, micro):
    ds = _ds()
    G = 8
    for step in (0, 5, 17):  # 17 crosses into the second epoch
        want = ds.samples(step * G, G)
        got = []
        for m in range(G // (world * micro)):
            for r in range(world):
                w = ds.step_batches(step, G, micro, r, world)[m]
                got.append(np.concatenate([w.input_ids.numpy(), w.labels.numpy()[:, -1:]], axis=1))
        assert np.array_equal(np.concatenate(got), want)


def test_resume_position_is_the_step_and_epochs_reshuffle():
    a, b = _ds(), _ds()
    for step in range(20):  # a walks through twenty steps; b jumps straight to step 20
        a.step_batches(step, 8, 4, 0, 1)
    assert all((x.input_ids == y.input_ids).all() for x, y in zip(a.step_batches(20, 8, 4, 0, 1),
                                                                   b.step_batches(20, 8, 4, 0, 1)))
    n = a.num_windows
    first, second = a.samples(0, n), a.samples(n, n)
    assert sorted(map(tuple, first)) == sorted(map(tuple, second)) and not np.array_equal(first, second)
    assert not np.array_equal(_ds(seed=4).samples(0, 8), a.samples(0, 8))


def test_too_little_data_and_bad_world_size():
    with pytest.raises(ShardfitError, match="fewer than one sequence"):
        PackedDataset(np.arange(10, dtype=np.uint32), 16, 0)
    with pytest.raises(ShardfitError, match="not a multiple of micro_batch x world size"):
        _ds().step_batches(0, 8, 4, 0, 3)
