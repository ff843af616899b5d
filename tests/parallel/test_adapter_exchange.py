"""parallel/adapter_exchange.py on 2 gloo ranks: K models' shards of parameters sharded (Shard(0),) as FSDP2 shards
them (torch.chunk: uneven, and a rank with no rows when the parameter has fewer rows than ranks) gathered whole on
every rank in one all-gather, and per-rank whole gradients reduced to each rank's shard of their average."""

from __future__ import annotations

from tests._dist import run_ranks

SHAPES = [(3, 5), (1, 4), (4, 2)]  # 3 rows: 2 + 1; 1 row: rank 1 holds none; 4 rows: 2 + 2


def _exchange(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardfit.parallel.adapter_exchange import gather_whole, reduce_to_shards, shard_group

    mesh = init_device_mesh("cpu", (world,))
    full = [[torch.arange(r * c, dtype=torch.float32).view(r, c) + 100 * k for r, c in SHAPES] for k in range(2)]
    params = [distribute_tensor(t, mesh, [Shard(0)]) for t in full[0]]
    group = shard_group(params)
    shards = [[distribute_tensor(t, mesh, [Shard(0)]).to_local() for t in model] for model in full]
    whole = gather_whole(params, shards, group)
    grads = [[t * (rank + 1) for t in model] for model in full]  # each rank its own whole gradient
    reduced = reduce_to_shards(params, grads, group)
    # the mean of rank 0's x1 and rank 1's x2
    want = [[distribute_tensor(t * 1.5, mesh, [Shard(0)]).to_local() for t in model] for model in full]
    return {"whole": all(bool(torch.equal(w, f)) for wm, fm in zip(whole, full) for w, f in zip(wm, fm)),
            "reduced": all(r.shape == w.shape and bool(torch.allclose(r, w)) for rm, wm in zip(reduced, want)
                           for r, w in zip(rm, wm)),
            "rows": [[list(s.shape) for s in model] for model in reduced]}


def test_uneven_and_empty_shards_gather_whole_and_reduce_back():
    one, two = run_ranks(_exchange, 2)
    assert one["whole"] and two["whole"]
    assert one["reduced"] and two["reduced"]
    assert one["rows"][0] == [[2, 5], [1, 4], [2, 2]] and two["rows"][0] == [[1, 5], [0, 4], [2, 2]]
