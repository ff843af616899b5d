"""A GRPO-style step with shardfit's Engine behind Ray actors, the way RL frameworks (SkyRL, verl, OpenRLHF, NeMo-RL)
run their trainer workers: N actors in one placement group (one bundle per rank: a GPU each where the cluster has
GPUs, a CPU otherwise), each one Engine rank of one process group, driven from the driver with Ray's own calls
(ray.remote, placement_group, ray.wait / ray.get with a timeout).

One step, from the driver:
  1. rollouts: given token lists here (prompt + completion and its reward, as a sampler returns them; the Engine
     samples nothing yet); advantages normalised within each prompt's group, A = (r - mean) / (std + 1e-6);
  2. `forward`: the policy's log-probs of the completions before the update (GRPO's "old" log-probs);
  3. `forward_backward` with the policy loss (`ppo` or `importance_sampling`), then `optim_step`;
  4. `weights()`: full tensors under Hugging Face names, one bucket per actor call through Ray's object store, into
     the driver's stand-in for an inference engine (`ReceivedWeights.load_weights`). Every rank iterates to the end
     (each parameter's gather is a collective); rank 0 returns the buckets, the others consume theirs;
  5. `save_state` after the step. A rank that dies (killed, out of memory, a lost node) fails the step on the
     driver as one line naming the rank, within seconds; the group is then torn down (its survivors would wait in
     a collective with the dead rank: over NCCL until the process group's timeout) and a new one resumes from the
     last save_state, exactly.

The sums are the same every step, so the policy learns them: the rewarded tokens' log-prob, printed each step, rises
from about -5.6 (uniform over the tiny model's 264 ids) to about -2 in 10 steps. Every Engine call is in `EngineRank`,
the actor class: nothing else here touches the Engine.

    pip install 'shardfit[ray]'
    python examples/ray_engine.py                   # 2 ranks on this machine's CPUs, the embedded tiny model
    python examples/ray_engine.py --address auto --ranks 8 --save-dir /shared/ckpt -- --model.path=/models/Qwen3-8B
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from shardfit.errors import ShardfitError
from shardfit.rl import AdamParams, Datum, make_datum

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # main() says how to install it; the test skips
    ray = None

INSTALL = "examples/ray_engine.py needs Ray: pip install 'shardfit[ray]'"
EOS = 257  # the byte tokenizer's end of sequence (ids 0-255 are UTF-8 bytes)
LOSS_CONFIG = {  # GRPO's per-sequence mean; log-probs and loss over the completions' tokens only (their mask)
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "normalize": "sequence_mean",
            "logprobs_at": "counted"},
    "importance_sampling": {"normalize": "sequence_mean", "logprobs_at": "counted"},
}
# After one rank fails, how long the others get to finish or fail before the group is killed: a dead peer fails the
# survivors' gloo collectives within seconds, while NCCL ones wait for the process group's timeout.
FAULT_GRACE_S = 15.0


# ---------------------------------------------------------------------------------------------- the actor: one rank
class EngineRank:
    """One Engine rank: the example's only Engine calls. EngineGroup runs it as a Ray actor; the test runs it in
    the processes of a 2-rank torch.multiprocessing group as the reference. Every method is called on every rank
    with the same arguments, in the same order (the Engine's calls are collectives)."""

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for the process group's store (asked of rank 0's actor: a
        port free on the driver's host means nothing on another node)."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, rank: int, world: int, master_addr: str | None, master_port: int | None,
              overrides: list[str], group_timeout_s: float) -> dict:
        """Join the process group (unless one exists, as in the test's reference), then start the Engine in it."""
        import datetime

        import torch
        import torch.distributed as dist

        # Engine first: shardfit imports torch.distributed.checkpoint before any group exists (parallel/dist.py)
        from shardfit import Engine

        if not dist.is_initialized():
            # what torchrun would set; LOCAL_RANK 0: Ray shows each actor its one GPU (CUDA_VISIBLE_DEVICES)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR=master_addr,
                              MASTER_PORT=str(master_port))
            gpu = torch.cuda.is_available()
            dist.init_process_group("nccl" if gpu else "gloo", init_method="env://", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=group_timeout_s),
                                    **({"device_id": torch.device("cuda", 0)} if gpu else {}))
        self.rank = rank
        self.engine = Engine.start(overrides=overrides)
        self._buckets = None
        return {"pid": os.getpid(), "host": os.uname().nodename, "device": str(self.engine.device),
                "notices": self.engine.notices}

    def forward(self, datums: list[Datum], loss_fn: str, config: dict):
        return self.engine.forward(datums, loss_fn, config)

    def forward_backward(self, datums: list[Datum], loss_fn: str, config: dict):
        return self.engine.forward_backward(datums, loss_fn, config)

    def optim_step(self, adam: AdamParams) -> dict:
        return self.engine.optim_step(adam)

    def open_weights(self, dtype: str, bucket_bytes: int) -> None:
        import torch

        self._buckets = iter(self.engine.weights(getattr(torch, dtype), bucket_bytes))

    def next_bucket(self) -> list | None:
        """The next bucket of open_weights' stream: [(name, host tensor)] on rank 0, [] on the others (which gather
        it too: a collective), None on every rank after the last."""
        bucket = next(self._buckets, None)
        if bucket is None:
            self._buckets = None
            return None
        return [(name, t.cpu()) for name, t in bucket] if self.rank == 0 else []

    def save_state(self, root: str) -> str:
        return str(self.engine.save_state(root))

    def load_state(self, path: str) -> int:
        self.engine.load_state(path)
        return self.engine.step


# ------------------------------------------------------------------------------------------- the driver's group
class GroupFault(ShardfitError):
    """A rank of the group died, failed or hung: the group is shut down; start a new one and load_state."""

    def __init__(self, message: str, *, ranks: list[int], where: str, fix: str):
        super().__init__(message, where=where, fix=fix)
        self.ranks = ranks


class EngineGroup:
    """`ranks` EngineRank actors in one placement group, joined in one process group, driven from here.

    call(method, *args) runs it on every rank and returns rank 0's result. A rank that dies or fails, or a call
    that outlasts call_timeout_s, shuts the whole group down and raises one GroupFault line naming the rank; bad
    input (a ShardfitError raised alike on every rank, before any collective) leaves the group as it was."""

    def __init__(self, ranks: int, overrides: list[str], *, actor_cls=EngineRank, start_timeout_s: float = 600.0,
                 call_timeout_s: float = 1800.0, group_timeout_s: float = 1800.0):
        self.world, self.call_timeout_s, self.closed = ranks, call_timeout_s, False
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= ranks else 0
        bundles = [{"CPU": 1, "GPU": 1} if gpus else {"CPU": 1} for _ in range(ranks)]
        self.pg = placement_group(bundles, strategy="PACK")  # a node's ranks together: NVLink before the network
        self.info: list[dict] = [{} for _ in range(ranks)]
        self.actors = []
        try:
            try:
                ray.get(self.pg.ready(), timeout=start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ShardfitError(f"Ray did not place {ranks} bundles of {bundles[0]} within "
                                    f"{start_timeout_s:.0f} s (the cluster has {ray.cluster_resources()})",
                                    where="--ranks", fix="start fewer ranks, or add nodes to the cluster") from None
            actor = ray.remote(actor_cls)
            self.actors = [actor.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=r))).remote()
                for r in range(ranks)]
            addr, port = self._results([self.actors[0].address.remote()], "address", start_timeout_s)[0]
            self.info = self._results([a.start.remote(r, ranks, addr, port, overrides, group_timeout_s)
                                       for r, a in enumerate(self.actors)], "start", start_timeout_s)
        except BaseException:  # nothing left behind: not a half-started group, not its bundles
            self.shutdown()
            raise

    def call(self, method: str, *args, timeout_s: float | None = None):
        """method(*args) on every rank; rank 0's result."""
        if self.closed:
            raise ShardfitError("this group was shut down", where=f"EngineGroup.call({method!r})",
                                fix="start a new EngineGroup and load_state the last save_state")
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return self._results(refs, method, timeout_s or self.call_timeout_s)[0]

    def _results(self, refs: list, what: str, timeout_s: float) -> list:
        """Each rank's result, by rank (refs[r] is rank r's call), waited for with ray.wait and ray.get."""
        rank_of = {ref: r for r, ref in enumerate(refs)}
        out, failures = [None] * len(refs), {}
        deadline = time.monotonic() + timeout_s
        while rank_of:
            ready, _ = ray.wait(list(rank_of), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            r = rank_of.pop(ready[0])
            try:
                out[r] = ray.get(ready[0], timeout=timeout_s)
            except ray.exceptions.RayActorError as e:  # the actor's process is gone
                failures[r] = e
            except ray.exceptions.RayTaskError as e:  # the method raised
                failures[r] = e.cause if e.cause is not None else e
            except ray.exceptions.RayError as e:  # Ray lost the result (an object, a node)
                failures[r] = e
            if failures:
                deadline = min(deadline, time.monotonic() + FAULT_GRACE_S)
        if not failures and not rank_of:
            return out
        if not rank_of and all(isinstance(e, ShardfitError) for e in failures.values()):
            raise failures[min(failures)]  # bad input, refused alike by every rank: the group is still in step
        self.shutdown()
        raise self._fault(what, failures, sorted(rank_of.values()), timeout_s)

    def _fault(self, what: str, failures: dict, hung: list[int], timeout_s: float) -> GroupFault:
        """One line for the first thing that went wrong: a dead rank, else a rank's error, else the ranks that hung."""
        dead = sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError))
        if dead:
            ranks, message = dead, f"died during {what} (the actor's process exited)"
        elif failures:
            e = failures[min(failures)]
            ranks, message = [min(failures)], f"failed in {what}: {type(e).__name__}: {str(e).strip()[:300]}"
        else:
            ranks, message = hung, f"did not finish {what} within {timeout_s:.0f} s"
        names = ", ".join(map(str, ranks))
        where = "; ".join(f"Ray actor of rank {r} (pid {self.info[r].get('pid', '?')} on "
                          f"{self.info[r].get('host', '?')})" for r in ranks)
        return GroupFault(f"rank{'s' if len(ranks) > 1 else ''} {names} {message}; the group was shut down",
                          ranks=ranks, where=where, fix="start a new EngineGroup and load_state the last save_state")

    def shutdown(self) -> None:
        """Kill every actor (a survivor waiting in a collective included) and free the placement group."""
        self.closed = True
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)


# ----------------------------------------------------------------------------------------------- one GRPO step
@dataclass
class Rollout:
    prompt: list[int]
    completion: list[int]  # the sampled tokens, EOS included
    reward: float


def given_rollouts(step: int, prompts: int = 4, samples: int = 4, seed: int = 0) -> list[list[Rollout]]:
    """A sampler's output, made up: for each of `prompts` sums "a+b=" (the same every step), `samples` completions,
    each the sum or a near miss, then EOS; reward 1 for the sum. Deterministic in (seed, step): a restarted run
    sees the same."""
    sums, rng = np.random.default_rng(seed).integers(0, 50, (prompts, 2)), np.random.default_rng([seed, step])
    groups = []
    for a, b in sums.tolist():
        answers = [a + b + (0 if rng.random() < 0.5 else int(rng.integers(1, 10))) for _ in range(samples)]
        groups.append([Rollout(list(f"{a}+{b}=".encode()), list(str(c).encode()) + [EOS], float(c == a + b))
                       for c in answers])
    return groups


def policy_datums(groups: list[list[Rollout]], logprobs: list | None = None) -> list[Datum]:
    """One datum per rollout: the model reads prompt + completion [:-1] and position t scores token t + 1; mask 1
    on the completion's positions, the group-normalised advantage there, and (given) the old log-probs."""
    datums = []
    for group in groups:
        rewards = np.array([ro.reward for ro in group])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for ro, adv in zip(group, advantages):
            seq = ro.prompt + ro.completion
            mask = np.array([0.0] * (len(ro.prompt) - 1) + [1.0] * len(ro.completion))
            extra = {"logprobs": logprobs[len(datums)]} if logprobs is not None else {}
            datums.append(make_datum(seq[:-1], target_tokens=seq[1:], mask=mask, advantages=mask * adv, **extra))
    return datums


class ReceivedWeights:
    """The driver's side of the weight sync, standing in for an inference engine: load_weights takes a bucket of
    (Hugging Face name, tensor) pairs as vLLM's model.load_weights or SGLang's update_weights_from_tensor do."""

    def __init__(self):
        self.tensors, self.buckets = {}, 0

    def load_weights(self, bucket: list) -> None:
        self.tensors.update(bucket)
        self.buckets += 1


def grpo_step(group, groups: list[list[Rollout]], loss: str, lr: float, receiver: ReceivedWeights,
              dtype: str = "bfloat16", bucket_bytes: int = 1 << 28) -> dict:
    """forward (the old log-probs), forward_backward with the policy loss, optim_step, then the weights to
    `receiver`, bucket by bucket. `group` is an EngineGroup (or anything with its call)."""
    old = group.call("forward", policy_datums(groups), "cross_entropy", {"logprobs_at": "counted"})
    old_logprobs = [o["logprobs"] for o in old.outputs]
    fb = group.call("forward_backward", policy_datums(groups, old_logprobs), loss, LOSS_CONFIG[loss])
    opt = group.call("optim_step", AdamParams(learning_rate=lr, grad_clip_norm=1.0))
    group.call("open_weights", dtype, bucket_bytes)
    while (bucket := group.call("next_bucket")) is not None:
        receiver.load_weights(bucket)
    rollouts = [ro for g in groups for ro in g]
    rewarded = [lp[-len(ro.completion):] for ro, lp in zip(rollouts, old_logprobs) if ro.reward > 0]
    return {"loss": fb.metrics["loss:sum"], "old_logprobs": old_logprobs,
            "logprobs": [o["logprobs"] for o in fb.outputs], "grad_norm": opt["grad_norm:mean"],
            "rewarded_logp": float(np.concatenate(rewarded).mean()) if rewarded else float("nan")}


# ---------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="arguments after -- are shardfit config overrides (--model.path=...)")
    parser.add_argument("--address", default=None, help="a Ray cluster to join ('auto'); default: a local one")
    parser.add_argument("--ranks", type=int, default=2, help="Engine ranks: one actor (and GPU, if any) each")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--loss", choices=sorted(LOSS_CONFIG), default="ppo")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the made-up rollouts")
    parser.add_argument("--save-dir", default="runs/ray-engine",
                        help="save_state after every step (a directory every node sees)")
    parser.add_argument("--restarts", type=int, default=1, help="new groups after a rank dies, each from the last save")
    parser.add_argument("--weights-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--call-timeout", type=float, default=1800.0, help="seconds one call may take on the ranks")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = parser.parse_args(argv[:cut]), argv[cut + 1:] or ["--model.name=tiny",
                                                                       "--train.micro_batch_tokens=256"]
    if ray is None:
        print(INSTALL, file=sys.stderr)
        return 2
    if args.address:
        ray.init(address=args.address)
    else:  # oversubscribed if need be: the tiny model's ranks are light
        ray.init(num_cpus=max(args.ranks, os.cpu_count() or 1), include_dashboard=False)
    try:
        return run(args, overrides)
    except ShardfitError as e:
        print(e.cli_line(), file=sys.stderr)
        return 2
    finally:
        ray.shutdown()


def run(args, overrides: list[str]) -> int:
    def new_group() -> EngineGroup:
        t0 = time.perf_counter()
        group = EngineGroup(args.ranks, overrides, call_timeout_s=args.call_timeout)
        print(f"{args.ranks} ranks on {sorted({i['host'] for i in group.info})} ({group.info[0]['device']}) "
              f"started in {time.perf_counter() - t0:.1f} s")
        for line in group.info[0]["notices"]:  # the Engine's own lines: the model loaded, LoRA, offload, ...
            print(line)
        return group

    group, saved, restarts, step = new_group(), None, 0, 0
    while step < args.steps:
        receiver, t0 = ReceivedWeights(), time.perf_counter()
        try:
            out = grpo_step(group, given_rollouts(step, args.prompts, args.samples, args.seed), args.loss, args.lr,
                            receiver, args.weights_dtype, args.bucket_mb << 20)
            saved = group.call("save_state", args.save_dir)
        except GroupFault as e:
            if restarts >= args.restarts:
                raise
            restarts += 1
            print(f"{e}\nrestarting the group from {saved or 'the initial weights'}")
            group = new_group()
            if saved:
                group.call("load_state", saved)
            continue  # the same step again, from the state before it
        step += 1
        size = sum(t.nbytes for t in receiver.tensors.values()) / 2**20
        print(f"step {step}: rewarded tokens' log-prob {out['rewarded_logp']:.3f}  grad_norm {out['grad_norm']:.3f}  "
              f"weights {len(receiver.tensors)} tensors / {size:.1f} MiB in {receiver.buckets} buckets  "
              f"saved {saved}  ({time.perf_counter() - t0:.1f} s)")
    group.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
