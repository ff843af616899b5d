"""One optimizer step's Adam hyperparameters as the RL API takes them (Tinker's names and defaults), checked in one
place: by the Engine for in-process callers (engine/optim.py's AdamParams) and by `shardfit serve` before a request
is queued (serve/schemas.py), so that a bad value is a 400 naming the key and never reaches the optimizer. Torch-free:
the HTTP layer imports it without the model stack."""

from __future__ import annotations

import math
from collections.abc import Mapping

from shardfit.errors import ShardfitError, shown

# tinker.types.AdamParams' defaults; grad_clip_norm 0 means no clipping
ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}


def adam_values(given: Mapping[str, object], where: str) -> dict[str, float]:
    """`given`'s Adam hyperparameters, missing ones at Tinker's defaults, as floats; a ShardfitError naming
    `where`.<key> for a value that is not a finite number >= 0, a beta not below 1, or an eps that is 0 in float32."""
    out = {}
    for key, default in ADAM_DEFAULTS.items():
        v = given.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ShardfitError(f"{key}={shown(v)} is not a finite number >= 0", where=f"{where}.{key}",
                                fix=f"send a finite, non-negative number (Tinker's default is {default})")
        out[key] = float(v)
    for key in ("beta1", "beta2"):
        if out[key] >= 1:
            raise ShardfitError(f"{key}={out[key]} must be below 1", where=f"{where}.{key}",
                                fix=f"send a value in [0, 1) (Tinker's default is {ADAM_DEFAULTS[key]})")
    if out["eps"] < 1e-45:  # 0 in float32: a zero gradient (LoRA's A at first) steps by 0 / 0, NaN weights for good
        raise ShardfitError(f"eps={out['eps']} divides by zero where a gradient is zero, leaving NaN weights",
                            where=f"{where}.eps", fix="send a positive eps (Tinker's default is 1e-12)")
    return out

