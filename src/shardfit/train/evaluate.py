"""Validation loss: forwards without gradients over the validation set, reduced once across ranks.

Every rank runs the same number of forwards (BatchSource.validation pads the last round with empty rows), since
each forward all-gathers FSDP's parameters; then one all-gather of (summed loss, loss tokens) per rank gives every
rank the same mean. The MoE load-balancing term is left out: the figure is the cross-entropy alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from shardfit.parallel import all_gather_rows
from shardfit.train.batches import LocalBatch


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[LocalBatch], device: torch.device) -> dict:
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for b in batches:
        ids = b.input_ids.to(device, non_blocking=True)
        labels = b.labels.to(device, non_blocking=True)
        positions = b.position_ids.to(device, non_blocking=True) if b.position_ids is not None else None
        loss_sum += model(ids, labels, positions, b.mask, router_aux=False).double()
        tokens += b.loss_tokens
    rows = all_gather_rows(torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64,
                                                               device=device)])).cpu()
    n = float(rows[:, 1].sum())
    return {"val_loss": float(rows[:, 0].sum()) / n if n else float("nan"), "val_tokens": int(n),
            "val_s": time.perf_counter() - t0}
