"""The run's length in passes over the data: train.epochs turned into steps, and the header's schedule line.

With train.epochs = E the run is ceil(I / G) steps, I the items (packed rows, examples or pretraining windows) in
the first E passes over the training set (a packed set's passes each pack their own permutation, so I sums their
own row counts) and G the global batch; the warm-up is the loader's fraction of those steps unless
train.warmup_steps was given. Steps cross pass boundaries: a step's rows are items step*G .. step*G + G - 1 of the
run (data/dataset.py), so the last step may take a few items of the next pass. Everything here depends only on the
data, data.seed and the config, so every rank, and a resumed run, derives the same steps without a collective; the
resolved config (config.toml) records them, with a comment saying where they came from.
"""

from __future__ import annotations

import math

from shardfit.config import Config
from shardfit.config.loader import check_steps
from shardfit.config.shape import StepShape


def item_unit(cfg: Config, ds) -> str:
    """What one item of the step's global batch is, as the header names it."""
    if hasattr(ds, "pairs"):  # preference training (data/preference.py, data/unpaired.py): pairs or examples
        return ds.unit
    if StepShape.of(cfg).by_tokens or not hasattr(ds, "examples"):
        return "examples" if hasattr(ds, "examples") else "windows"
    return "packed rows" if hasattr(ds, "fill") else "examples"


def apply_epochs(cfg: Config, ds) -> str | None:
    """With train.epochs: set train.steps (and the warm-up left to the data) and check the rules that name a step;
    the comment config.toml carries about it. None without train.epochs."""
    t = cfg.train
    if not t.epochs:
        return None
    t.steps = max(1, math.ceil(ds.items_in(t.epochs) / t.global_batch))
    if t.warmup_fraction is not None:
        t.warmup_steps = max(1, round(t.warmup_fraction * t.steps))
    check_steps(cfg)
    return (f"# train.steps = {t.steps}: train.epochs = {t.epochs:g} over {ds.num_windows:,} {item_unit(cfg, ds)} "
            f"a pass, {t.global_batch} a step (train.epochs is 0 below: the steps are resolved)\n")


def schedule_lines(cfg: Config, ds, per_round: int) -> list[str]:
    """The header's schedule (steps, passes over the data, warm-up and decay) and, when one step holds more items
    than the training set, a warning with the fix. per_round: the items one micro-batch round takes (micro-batch x
    data-parallel ranks; the ranks alone under token budgets), which the global batch must be a multiple of."""
    t, n = cfg.train, ds.num_windows
    unit = item_unit(cfg, ds)
    passes = t.steps * t.global_batch / n
    given = f"train.epochs={t.epochs:g}" if t.epochs else f"train.steps={t.steps}"
    decay = (f"cosine decay to {t.min_lr_ratio:g} x {t.lr:g} at step {t.steps}" if t.steps > t.warmup_steps
             else "no decay")
    warm = min(t.warmup_steps, t.steps)
    plural = lambda k: "s" if k != 1 else ""  # noqa: E731
    lines = [f"schedule: {t.steps:,} step{plural(t.steps)} x {t.global_batch} {unit} = {passes:,.2f} passes over the "
             f"training set's {n:,} {unit} ({given}); lr warm-up {warm} step{plural(warm)}, then {decay}"]
    if t.global_batch > n:
        said = (f"train.epochs={t.epochs:g} trains {passes:,.2f} passes" if t.epochs else
                f"every step sees the data {t.global_batch / n:.1f} times")
        lines.append(f"warning: one step holds train.global_batch={t.global_batch} {unit} but the training set has "
                     f"{n:,}: {said}; fix: {_step_within(cfg, n, unit, per_round)}")
    return lines


def _step_within(cfg: Config, n: int, unit: str, per_round: int) -> str:
    """The flags that make one step hold at most the training set's n items: a global batch that is a multiple of
    per_round (micro-batch x data-parallel ranks), the micro-batch lowered when n is below per_round; data when the
    ranks alone need more than n."""
    t = cfg.train
    ranks = per_round if t.micro_batch_tokens else per_round // t.micro_batch
    if n >= per_round:
        return f"--train.global_batch={n // per_round * per_round}, or add data"
    if n >= ranks:  # the micro-batch is more than the data holds: a smaller one, the same ranks
        return f"--train.global_batch={n // ranks * ranks} --train.micro_batch={n // ranks}, or add data"
    return f"add data: {ranks} data-parallel ranks take at least {ranks} {unit} a step"
