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
    def __init__(self, log):
        self.log, self.calls = log, 0

    def weight_uses(self, uses):
        return [("w",)] * uses

    def __call__(self, xs, counts, weights=None):
        assert weights == ("w",) and xs.shape[0] == int(counts.sum())
        self.calls += 1
        return _Times2.apply(xs, "own" if self.calls == 1 else "remote", self.log)


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


def _exchange(rank, world):
    import torch.distributed as dist

    from shardfit.parallel import expert_overlap as eo

    log = []
    eo._LaunchDispatch = _logged(eo._LaunchDispatch, log, "launch")
    eo._WaitDispatch = _logged(eo._WaitDispatch, log, "wait")
    n_experts, hidden = 4, 3
    ex = eo.OverlappedExpertExchange(dist.group.WORLD, world, n_experts, rank)
    torch.manual_seed(rank)
    ids = torch.randint(0, n_experts, (10,))
    keys = ex.sort_keys(ids)
    order = torch.argsort(keys, stable=True)
    ids = ids[order]
    own = (ids // (n_experts // world) == rank)
    rows = torch.randn(10, hidden, dtype=torch.float64)[order].requires_grad_()
    counts = torch.bincount(ids, minlength=n_experts)
    out = ex(rows, counts, _Experts(log))
    weights = torch.arange(10, dtype=torch.float64)[:, None]
    (out * weights).sum().backward()
    return {"own_first": bool(own[:int(own.sum())].all()), "out": (out - 2 * rows).abs().max().item(),
            "grad": (rows.grad - 2 * weights).abs().max().item(), "log": log}


def test_the_dispatch_is_in_flight_while_the_own_rows_run_forward_and_backward():
    res = run_ranks(_exchange, 2)
    for r in res:
        assert r["own_first"]  # sort_keys puts the own experts' rows at the head
        assert r["out"] == 0 and r["grad"] == 0  # every row went to its expert and back, in place
        log = r["log"]
        # forward: launched, the own rows ran, then the wait, then the received rows
        assert log[:4] == ["launch forward", "own forward", "wait forward", "remote forward"]
        # backward: the received rows' backward, then the reverse exchange launched (wait's backward), the own rows'
        # backward while it is in flight, and its wait (launch's backward) last
        assert log[4:] == ["remote backward", "wait backward", "own backward", "launch backward"]
