"""Small configs and a plain single-process reference trainer for parity tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardfit.config import load_config
from shardfit.data import build_dataset
from shardfit.data.dataset import stack_rows
from shardfit.engine.optim import build_optimizer, lr_at, set_lr
from shardfit.models import build_model
from shardfit.models.attention import DocumentMask

# a resumed run with a longer schedule than its checkpoint's (train/run_config.py: refused unless allowed)
EXTEND = "--checkpoint.allow_changes=train.steps"
SMALL = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
         "--model.max_seq_len=64", "--data.seq_len=32", "--train.global_batch=8", "--train.micro_batch=4",
         "--train.warmup_steps=2", "--train.steps=4", "--train.lr=3e-3", "--logging.progress=none",
         "--checkpoint.final=false", "--compute.loss_chunk=48", "--logging.plot=false"]


def small_config(*extra: str, run_dir: str = ""):
    args = list(SMALL) + list(extra)
    if run_dir:
        args.append(f"--logging.run_dir={run_dir}")
    return load_config(None, args)


def reference_train(cfg, steps: int | None = None, device: str = "cpu"):
    """Plain PyTorch, one process, whole global batch at once: what sharded training must reproduce.

    Initial weights come from the device's own generator, so the reference must run on the same device type.
    """
    steps = steps or cfg.train.steps
    with torch.device(device):
        model = build_model(cfg.model)
    model.init_weights(cfg.train.seed)
    opt = build_optimizer(model, cfg.train, torch.device("cpu"))  # same (foreach) AdamW as the CPU path
    ds, _ = build_dataset(cfg.data, cfg.model.vocab_size)
    G = cfg.train.global_batch
    losses = []
    for step in range(steps):
        mb = stack_rows([ds.row(k) for k in range(step * G, (step + 1) * G)])
        inputs, labels = mb.input_ids.to(device), mb.labels.to(device)
        positions, mask = mb.position_ids, None
        if positions is not None and cfg.data.document_mask:  # packed documents: the dense-mask reference
            mask = DocumentMask.build(positions, "sdpa", torch.device(device))
            positions = positions.to(device) if mask is not None else None
        else:
            positions = None
        logits = model(inputs, position_ids=positions, mask=mask)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)  # mean over valid tokens
        loss.backward()
        if cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        set_lr(opt, lr_at(step, cfg.train))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model.cpu(), losses


def full_state(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict on every rank, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                broadcast_from_rank0=False))


def train_small(rank: int, world: int, run_dir: str, *extra: str) -> dict:
    """A short run of small_config (for tests/_dist.run_ranks); its losses."""
    from shardfit.train import Trainer

    return {"losses": [h["loss"] for h in Trainer(small_config(*extra, run_dir=run_dir)).fit()]}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: NF4 storage is carried in a float dtype (adapters/nf4.py), where some byte patterns
    are NaNs that torch.equal calls unequal to themselves."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def parallelize_config(model, cfg, device, world: int, seed: int = 0, init: bool = True):
    """parallelize (parallel/parallelize.py) as the Engine calls it: the layout of cfg on `world` ranks, this rank's
    (the process group's), and cfg's sections."""
    import torch.distributed as dist

    from shardfit.parallel.layout import ParallelLayout
    from shardfit.parallel.parallelize import parallelize

    rank = dist.get_rank() if dist.is_initialized() else 0
    return parallelize(model, ParallelLayout.of(cfg.parallel, world, rank, moe=cfg.model.n_experts > 0),
                       parallel=cfg.parallel, compute=cfg.compute, lora=cfg.lora, quantize=cfg.model.quantize,
                       device=device, seed=seed, init=init)


def random_datums(seed: int, n: int = 3, lengths: tuple[int, int] = (8, 20), weight: float = 1.0) -> list:
    """n next-token datums (shardfit.rl.make_datum) of random tokens < 256, lengths drawn in [lo, hi), every
    target weighted `weight`: the RL API's input in the registry, sampling and multi-model tests."""
    import numpy as np

    from shardfit.rl import make_datum

    rng = np.random.default_rng(seed)
    out = []
    for L in rng.integers(*lengths, n):
        s = rng.integers(0, 256, L + 1)
        out.append(make_datum(s[:-1], target_tokens=s[1:], weights=np.full(L, weight)))
    return out


def random_pairs(seed: int, n: int) -> list:
    """n preference pairs (chosen, then rejected: 2n datums, or KTO's 2n examples) of random tokens < 256, lengths
    in [6, 12): the completion (mask 1) after a prompt of a third of the datum, and made-up reference log-probs (the
    multi-model pair tests)."""
    import numpy as np

    from shardfit.rl import make_datum

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2 * n):
        L = int(rng.integers(6, 12))
        s = rng.integers(0, 256, L + 1)
        mask = (np.arange(L) >= L // 3).astype(np.float32)
        out.append(make_datum(s[:-1], target_tokens=s[1:], mask=mask, ref_logprobs=rng.normal(-5.0, 1.0, L)))
    return out
