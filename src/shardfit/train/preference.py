"""`shardfit train` with preference.objective (dpo, ipo, simpo, orpo, kto): the step's units of the data set (pairs;
KTO's labelled examples) as datums, through the RL API's pair pass (rl/preference.py: a pair's sequences in one
[1, T] row, document-masked, the loss exact over the global batch), the reference model's log-probs computed once
before training, and the validation set's metrics every train.eval_every steps.

A step takes train.global_batch units (samples step x G .. of the run's seeded order, data/dataset.py, so a resumed
run sees what an uninterrupted one would). The reference (DPO, IPO, KTO) is the model training starts from: its
per-token log-probs of every unit are computed in a no-grad pass over the whole data set before the first step (the
Engine's forward, train.global_batch units per call) and kept on the host; a KTO unit's two sequences are its example
and its KL sequence (data/unpaired.py). KTO's step first runs a no-grad forward of the policy over its examples' KL
sequences: z = max(0, mean over the step's examples of (policy - reference) log-prob sums), TRL's reference point
over the global batch (TRL's over each rank's micro-batch, averaged across ranks), a constant of the step's loss.
With LoRA the frozen base is the reference: the pass runs with the adapters' slot holding the base
(engine/registry.py BASE), so a resumed LoRA run computes the same values again. A run that trains every parameter
saves them in <run_dir>/reference_logprobs.npz (no pickle; the held-out units' in reference_logprobs_val.npz) and
a resumed one reads them back: its model is no longer the reference. Collectives: the pass's own (every rank runs the
same calls over the same list), and on resume one agreement on the file.

Validation (data.val_path or data.val_fraction, train.eval_every): the same pass without a gradient over the held-out
units, train.global_batch at a time (the reference's log-probs of them computed with the training set's), and TRL's
eval metrics: the mean loss, rewards, accuracies and margins over the held-out units (each chunk's means weighted by
its units), logged as eval records of metrics.jsonl.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import torch

from shardfit.config import Config
from shardfit.data.preference import PreferencePairs
from shardfit.engine import Engine
from shardfit.engine.preference import PairObjective
from shardfit.engine.registry import BASE
from shardfit.errors import ShardfitError
from shardfit.fsutil import write_atomic
from shardfit.parallel.agreement import agree
from shardfit.rl.datum import Datum, make_datum
from shardfit.rl.preference import pair_pass
from shardfit.rl.step import forward as datum_forward

REFERENCE_FILE = "reference_logprobs.npz"
REFERENCE_VAL_FILE = "reference_logprobs_val.npz"  # the held-out units'



def check_preference_config(cfg: Config) -> None:
    """What preference training needs of the rest of the config beyond the loader's rules (config/preference_rules.py:
    its token-budget rows), one line each."""
    if cfg.parallel.sequence_parallel > 1:
        raise ShardfitError("a pair's log-prob sums are taken within one rank's row; sequence parallelism splits it",
                            where="parallel.sequence_parallel", fix="set parallel.sequence_parallel=1")
    if cfg.train.eval_every and not (cfg.data.val_path or cfg.data.val_fraction > 0):
        raise ShardfitError(f"train.eval_every={cfg.train.eval_every} but no validation set", where="train.eval_every",
                            fix="give held-out pairs in data.val_path, or hold out data.val_fraction of data.path")


def objective_of(cfg: Config) -> PairObjective:
    p = cfg.preference
    return PairObjective(p.objective, p.beta, p.label_smoothing, p.simpo_gamma, p.desirable_weight,
                         p.undesirable_weight)


Reference = list[tuple[np.ndarray, np.ndarray]]  # per unit: its two sequences' per-token log-probs [n] each


class PreferenceSteps:
    """The trainer's step over units, the reference pass before the first one, and the validation pass."""

    def __init__(self, cfg: Config, pairs: PreferencePairs, run_dir: Path, val: PreferencePairs | None = None):
        self.cfg, self.pairs, self.run_dir, self.val = cfg, pairs, run_dir, val
        self.objective = objective_of(cfg)
        self.reference: dict[int, Reference] = {}  # id(data set) -> its reference (the training and held-out sets)

    @property
    def train_reference(self) -> Reference | None:
        return self.reference.get(id(self.pairs))

    def datums(self, index: int, data: PreferencePairs | None = None) -> list[Datum]:
        """Unit `index` of a data set (not of the run's order) as two datums: chosen, then rejected (KTO: the
        example, then its KL sequence)."""
        data = self.pairs if data is None else data
        ref = self.reference.get(id(data))
        out = []
        for j, s in enumerate(data.sides_of(index)):
            extra = {"ref_logprobs": ref[index][j]} if ref is not None else {}
            out.append(make_datum(s.tokens, target_tokens=s.targets, mask=s.counted.astype(np.float32), **extra))
        return out

    def unit_pass(self, engine: Engine, indices: list[int], backward: bool,
                  data: PreferencePairs | None = None) -> dict[str, float]:
        """The pair pass over units `indices` of a data set: TRL's metrics (with the mean loss when not training)."""
        data = self.pairs if data is None else data
        units = [self.datums(i, data) for i in indices]
        if self.objective.name != "kto":
            _, _, metrics = pair_pass(engine, [d for u in units for d in u], self.objective, backward,
                                      with_loss=not backward)
            return metrics
        cfg = {"desirable": [bool(data.labels[i]) for i in indices], "kl": self.kl_point(engine, units)}
        _, _, metrics = pair_pass(engine, [u[0] for u in units], self.objective, backward, cfg=cfg,
                                  where=f"data ({data.where})", with_loss=not backward)
        return metrics

    def kl_point(self, engine: Engine, units: list[list[Datum]]) -> float:
        """KTO's z: the policy's no-grad log-probs of the units' KL sequences against the reference's, the mean of
        the sums' differences, clamped at 0 (TRL's). Every rank computes it from the pass's gathered outputs."""
        kl = [u[1] for u in units]
        got = datum_forward(engine, kl, "cross_entropy", {"logprobs_at": "counted"}).outputs
        diffs = [float((o["logprobs"].astype(np.float64) - d.inputs["ref_logprobs"])[d.inputs["mask"] > 0].sum())
                 for o, d in zip(got, kl)]
        return max(0.0, float(np.mean(diffs)))

    def step(self, engine: Engine, step: int) -> tuple[dict[str, float], int]:
        """forward_backward over step `step`'s units: (TRL's metrics, units)."""
        G = self.cfg.train.global_batch
        return self.unit_pass(engine, [self.pairs.index(k) for k in range(step * G, (step + 1) * G)], True), G

    def evaluate(self, engine: Engine, beat=None) -> dict:
        """TRL's eval metrics over the held-out units (module docstring): the trainer's eval record."""
        t0, n, G = time.perf_counter(), self.val.num_windows, self.cfg.train.global_batch
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for first in range(0, n, G):
            if beat is not None:
                beat(f"validation, units {first + 1}-{min(first + G, n)} of {n}")
            indices = list(range(first, min(first + G, n)))
            m = self.unit_pass(engine, indices, False, self.val)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v * len(indices)
                weights[k] = weights.get(k, 0.0) + len(indices)
        mean = {k: sums[k] / weights[k] for k in sums}
        tokens = sum(int(s.counted.sum()) for i in range(n) for s in self.val.sides_of(i)[:self.objective.group])
        return {"val_loss": mean.pop("loss"), "val_tokens": tokens, "val_s": time.perf_counter() - t0,
                **{f"eval_{k}": v for k, v in mean.items()}}

    def prepare(self, engine: Engine, resumed: bool, say, beat=None) -> None:
        """The reference's log-probs of the training and held-out units, before the first step (objectives that
        need one). say: prints a line (rank 0); beat: the watchdog's, before each forward of the pass."""
        if not self.objective.needs_reference:
            return
        lora = engine.models.lora
        sets = [(self.pairs, self.run_dir / REFERENCE_FILE)]
        if self.val is not None and self.cfg.train.eval_every:  # held out to be evaluated
            sets.append((self.val, self.run_dir / REFERENCE_VAL_FILE))
        if resumed and not lora:
            for data, path in sets:
                problem = None if path.is_file() else f"{path} is missing: the reference (the model this run " \
                    "started from) is needed and a resumed model is not it"
                agree(problem, str(path), "start the run again (a new logging.run_dir), or train LoRA adapters, "
                      "whose base is the reference", engine.device)
                self.reference[id(data)] = load_reference(path, data)
                say(f"reference log-probs: read from {path}")
            return
        t0 = time.perf_counter()
        engine.using(BASE if lora else None)
        try:
            for data, _ in sets:
                self.reference[id(data)] = self.compute_reference(engine, beat, data)
        finally:
            engine.using("default" if lora else None)
        if engine.device.type == "cuda":  # once, before step 1: the no-grad pass's blocks, cached in shapes the
            torch.cuda.empty_cache()      # step does not reuse, would otherwise stay reserved beside the step's
        units = sum(d.num_windows for d, _ in sets)
        say(f"reference log-probs of {units:,} {self.pairs.unit} in {time.perf_counter() - t0:.1f} s ("
            + ("the frozen base, adapters off" if lora else "the starting model") + ")")
        if not lora and engine.dist.is_main:
            for data, path in sets:
                save_reference(path, self.reference[id(data)])

    def compute_reference(self, engine: Engine, beat=None, data: PreferencePairs | None = None) -> Reference:
        """No-grad log-probs of every unit's sequences' answer tokens (0 elsewhere), train.global_batch units per
        forward (each rank its share)."""
        data = self.pairs if data is None else data
        n, G = data.num_windows, self.cfg.train.global_batch
        out: Reference = []
        for first in range(0, n, G):
            if beat is not None:
                beat(f"reference log-probs, units {first + 1}-{min(first + G, n)} of {n} (a no-grad pass)")
            datums = [d for i in range(first, min(first + G, n)) for d in self.datums(i, data)]
            # the answers' tokens alone (their mask): the prompts' log-probs are never read
            lps = [o["logprobs"] for o in datum_forward(engine, datums, "cross_entropy",
                                                       {"logprobs_at": "counted"}).outputs]
            out += [(lps[2 * k], lps[2 * k + 1]) for k in range(len(lps) // 2)]
        return out


def mean_metrics(window: list[dict[str, float]]) -> dict[str, float]:
    """The steps' metrics since the last log line, averaged (TRL logs its means over the logging steps); a key
    some steps lack (KTO's, for a kind absent from a step) over the steps that have it."""
    keys = dict.fromkeys(k for m in window for k in m)
    return {k: float(np.mean([m[k] for m in window if k in m])) for k in keys}


def save_reference(path: Path, reference: list[tuple[np.ndarray, np.ndarray]]) -> None:
    flat = [a for pair in reference for a in pair]
    buf = io.BytesIO()
    np.savez(buf, values=np.concatenate(flat).astype(np.float32),
             lengths=np.asarray([len(a) for a in flat], dtype=np.int64))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buf.getvalue())


def load_reference(path: Path, pairs: PreferencePairs) -> list[tuple[np.ndarray, np.ndarray]]:
    with np.load(path, allow_pickle=False) as f:
        values, lengths = f["values"], f["lengths"]
    want = [len(s.tokens) for i in range(pairs.num_windows) for s in pairs.sides_of(i)]
    if lengths.tolist() != want:
        raise ShardfitError(f"holds the reference of other data ({len(lengths) // 2:,} pairs)", where=str(path),
                            fix="resume with the data and data.seq_len the run started with")
    flat = np.split(values, np.cumsum(lengths)[:-1])
    return [(flat[2 * k], flat[2 * k + 1]) for k in range(len(flat) // 2)]
