"""parallel/expert_overlap.py: the dispatch is in flight while the own rows run, forward and backward."""

import torch

from tests._dist import run_ranks


class _Times2(torch.autograd.Function):
    """The experts stand-in: y = 2x, logging its forward and backward under its tag."""

    @staticmethod
    def forward(ctx, x, tag, log):
        ctx.tag, ctx.log = tag, log
        log.append(f"{tag} forward")
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(f"{ctx.tag} backward")
        return 2 * grad, None, None


class _Experts:
    """Called in the order own, remote (dispatch) or own A, remote, own B (both)."""

    def __init__(self, log, tags):
        self.log, self.tags = log, list(tags)

    def weight_uses(self, uses):
        assert uses == len(self.tags)
        return [(f"w{i}",) for i in range(uses)]

    def __call__(self, xs, counts, weights=None):
        assert xs.shape[0] == int(counts.sum()) and (counts >= 0).all()
        tag = self.tags.pop(0)
        self.log.append(f"{tag} uses {weights[0]}")
        return _Times2.apply(xs, tag, self.log)


def _logged(cls, log, name):
    """cls with its forward and backward logged as `name launch/wait ...`."""

    class Logged(cls):
        @staticmethod
        def forward(ctx, *args):
            out = cls.forward(ctx, *args)
            log.append(f"{name} forward")
            return out

        @staticmethod
        def backward(ctx, *grads):
            out = cls.backward(ctx, *grads)
            log.append(f"{name} backward")
            return out

    return Logged


def _exchange(rank, world, both):
    import torch.distributed as dist

    from shardfit.parallel import expert_overlap as eo

    log = []
    for name in ("LaunchDispatch", "WaitDispatch", "LaunchCombine", "WaitCombine"):
        setattr(eo, f"_{name}", _logged(getattr(eo, f"_{name}"), log, name))
    n_experts, hidden = 4, 3
    kind = eo.FullyOverlappedExpertExchange if both else eo.OverlappedExpertExchange
    ex = kind(dist.group.WORLD, world, n_experts, rank)
    torch.manual_seed(rank)
    ids = torch.randint(0, n_experts, (10,))
    keys = ex.sort_keys(ids)
    order = torch.argsort(keys, stable=True)
    ids = ids[order]
    own = (ids // (n_experts // world) == rank)
    rows = torch.randn(10, hidden, dtype=torch.float64)[order].requires_grad_()
    counts = torch.bincount(ids, minlength=n_experts)
    out = ex(rows, counts, _Experts(log, ["ownA", "remote", "ownB"] if both else ["own", "remote"]))
    weights = torch.arange(10, dtype=torch.float64)[:, None]
    (out * weights).sum().backward()
    return {"own_first": bool(own[:int(own.sum())].all()), "out": (out - 2 * rows).abs().max().item(),
            "grad": (rows.grad - 2 * weights).abs().max().item(), "log": log}


def test_the_dispatch_is_in_flight_while_the_own_rows_run_forward_and_backward():
    for r in run_ranks(_exchange, 2, False):
        assert r["own_first"]  # sort_keys puts the own experts' rows at the head
        assert r["out"] == 0 and r["grad"] == 0  # every row went to its expert and back, in place
        # forward: launched, the own rows ran, then the wait, then the received rows; the combine back to back.
        # Backward: the combine's reverse waited at once; the received rows' backward, then the dispatch's reverse
        # launched (wait's backward), the own rows' backward while it is in flight, and its wait (launch's backward)
        assert r["log"] == [
            "LaunchDispatch forward", "own uses w0", "own forward", "WaitDispatch forward", "remote uses w1",
            "remote forward", "LaunchCombine forward", "WaitCombine forward",
            "WaitCombine backward", "LaunchCombine backward", "remote backward", "WaitDispatch backward",
            "own backward", "LaunchDispatch backward"]


def test_both_exchanges_are_in_flight_while_a_half_of_the_own_rows_runs():
    for r in run_ranks(_exchange, 2, True):
        assert r["own_first"] and r["out"] == 0 and r["grad"] == 0
        # each half of the own rows under one exchange, forward and backward; each use its own weights' output
        assert r["log"] == [
            "LaunchDispatch forward", "ownA uses w0", "ownA forward", "WaitDispatch forward", "remote uses w2",
            "remote forward", "LaunchCombine forward", "ownB uses w1", "ownB forward", "WaitCombine forward",
            "WaitCombine backward", "ownB backward", "LaunchCombine backward", "remote backward",
            "WaitDispatch backward", "ownA backward", "LaunchDispatch backward"]
