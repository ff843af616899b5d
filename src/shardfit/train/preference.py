"""`shardfit train` with preference.objective (dpo, ipo, simpo): the step's pairs of the data set as datums, through
the RL API's pair pass (rl/preference.py: both sequences of a pair in one [1, T] row, document-masked, the loss
exact over the global batch), and the reference model's log-probs computed once before training.

A step takes train.global_batch pairs (samples step x G .. of the run's seeded order, data/dataset.py, so a resumed
run sees what an uninterrupted one would). The reference (DPO, IPO) is the model training starts from: its per-token
log-probs of every pair are computed in a no-grad pass over the whole data set before the first step (the Engine's
forward, train.global_batch pairs per call) and kept on the host. With LoRA the frozen base is the reference: the
pass runs with the adapters' slot holding the base (engine/registry.py BASE), so a resumed LoRA run computes the same
values again. A run that trains every parameter saves them in <run_dir>/reference_logprobs.npz (no pickle) and a
resumed one reads them back: its model is no longer the reference. Collectives: the pass's own (every rank runs the
same calls over the same list), and on resume one agreement on the file.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np

from shardfit.config import Config
from shardfit.config.shape import StepShape
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


def check_preference_config(cfg: Config) -> None:
    """What preference training needs of the rest of the config, one line each."""
    shape = StepShape.of(cfg)
    if not shape.by_tokens:
        raise ShardfitError("preference training packs each pair (chosen and rejected) into one token-budget row",
                            where="train.micro_batch_tokens",
                            fix=f"set --train.micro_batch_tokens={2 * cfg.data.seq_len} (at least 2 x data.seq_len)")
    if shape.budget < 2 * cfg.data.seq_len:
        raise ShardfitError(f"train.micro_batch_tokens={shape.budget} cannot hold a pair of two sequences of "
                            f"data.seq_len={cfg.data.seq_len}", where="train.micro_batch_tokens",
                            fix=f"set it to at least {2 * cfg.data.seq_len}, or lower data.seq_len")
    if cfg.parallel.sequence_parallel > 1:
        raise ShardfitError("a pair's log-prob sums are taken within one rank's row; sequence parallelism splits it",
                            where="parallel.sequence_parallel", fix="set parallel.sequence_parallel=1")
    if cfg.train.eval_every:
        raise ShardfitError("no validation set for preference training yet", where="train.eval_every",
                            fix="set train.eval_every=0 (rewards/accuracies and rewards/margins are in the log)")


def objective_of(cfg: Config) -> PairObjective:
    p = cfg.preference
    return PairObjective(p.objective, p.beta, p.label_smoothing, p.simpo_gamma)


class PreferenceSteps:
    """The trainer's step over pairs, and the reference pass before the first one."""

    def __init__(self, cfg: Config, pairs: PreferencePairs, run_dir: Path):
        self.cfg, self.pairs, self.run_dir = cfg, pairs, run_dir
        self.objective = objective_of(cfg)
        self.reference: list[tuple[np.ndarray, np.ndarray]] | None = None  # per pair: (chosen, rejected) [n] each

    def datums(self, index: int) -> list[Datum]:
        """Pair `index` of the data set (not of the run's order) as two datums: chosen, then rejected."""
        out = []
        for j, s in enumerate(self.pairs.sides_of(index)):
            extra = {"ref_logprobs": self.reference[index][j]} if self.reference is not None else {}
            out.append(make_datum(s.tokens, target_tokens=s.targets, mask=s.counted.astype(np.float32), **extra))
        return out

    def step(self, engine: Engine, step: int) -> tuple[dict[str, float], int]:
        """forward_backward over step `step`'s pairs: (TRL's metrics, pairs)."""
        G = self.cfg.train.global_batch
        datums = [d for k in range(step * G, (step + 1) * G) for d in self.datums(self.pairs.index(k))]
        _stats, _logprobs, metrics = pair_pass(engine, datums, self.objective, backward=True)
        return metrics, G

    def prepare(self, engine: Engine, resumed: bool, say, beat=None) -> None:
        """The reference's log-probs, before the first step (objectives that need one). say: prints a line (rank
        0); beat: the watchdog's, before each forward of the pass."""
        if not self.objective.needs_reference:
            return
        lora = engine.models.lora
        path = self.run_dir / REFERENCE_FILE
        if resumed and not lora:
            problem = None if path.is_file() else f"{path} is missing: the reference (the model this run started " \
                "from) is needed and a resumed model is not it"
            agree(problem, str(path), "start the run again (a new logging.run_dir), or train LoRA adapters, whose "
                  "base is the reference", engine.device)
            self.reference = load_reference(path, self.pairs)
            say(f"reference log-probs: read from {path}")
            return
        t0 = time.perf_counter()
        engine.using(BASE if lora else None)
        try:
            self.reference = self.compute_reference(engine, beat)
        finally:
            engine.using("default" if lora else None)
        say(f"reference log-probs of {len(self.reference):,} pairs in {time.perf_counter() - t0:.1f} s ("
            + ("the frozen base, adapters off" if lora else "the starting model") + ")")
        if not lora and engine.dist.is_main:
            save_reference(path, self.reference)

    def compute_reference(self, engine: Engine, beat=None) -> list[tuple[np.ndarray, np.ndarray]]:
        """No-grad log-probs of every pair's answer tokens (0 elsewhere), train.global_batch pairs per forward (each
        rank its share)."""
        n, G = self.pairs.num_windows, self.cfg.train.global_batch
        out: list[tuple[np.ndarray, np.ndarray]] = []
        for first in range(0, n, G):
            if beat is not None:
                beat(f"reference log-probs, pairs {first + 1}-{min(first + G, n)} of {n} (a no-grad pass)")
            datums = [d for i in range(first, min(first + G, n)) for d in self.datums(i)]
            # the answers' tokens alone (their mask): the prompts' log-probs are never read
            lps = [o["logprobs"] for o in datum_forward(engine, datums, "cross_entropy",
                                                       {"logprobs_at": "counted"}).outputs]
            out += [(lps[2 * k], lps[2 * k + 1]) for k in range(len(lps) // 2)]
        return out


def mean_metrics(window: list[dict[str, float]]) -> dict[str, float]:
    """The steps' metrics since the last log line, averaged (TRL logs its means over the logging steps)."""
    return {k: float(np.mean([m[k] for m in window])) for k in window[0]} if window else {}


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
