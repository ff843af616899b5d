"""Rollout-shaped RL data (issue 24) as shardfit Datums: the very sequences of the anchor hf_rl_step.py.

The generator is the anchor's own `make_rollouts` (imported, not copied): 64 sequences, prompt U[256, 1024] tokens,
response log-normal (median 1,000, sigma 1.0) clipped to [16, 16384], uniform random ids below the vocabulary, seed
1234; 178,786 tokens at scale 1 (`--scale` shrinks lengths for CPU checks, as the anchor's own flag does). The
anchor is looked up as <repo>/.anchors/hf_rl_step.py (the carried copy on a device call), then the project's
shared/anchors/ beside the checkout; `find_anchor(path)` takes an explicit one.

A sequence s of P + R tokens becomes one Datum of L = P + R - 1 tokens: tokens = s[:-1], target_tokens = s[1:]
(position t scores token t + 1, as the anchor's logits[t] -> s[t + 1]); the response targets are positions
P - 1 .. P + R - 2, where `mask` is 1 and `logprobs` / `advantages` hold the sampler's values (0 elsewhere). So
token_mean normalisation divides by the response tokens of the batch, the anchor's n_resp.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ANCHOR_NAME = "hf_rl_step.py"


def find_anchor(path: str | Path | None = None) -> Path:
    candidates = [Path(path)] if path else [ROOT / ".anchors" / ANCHOR_NAME,
                                             ROOT.parent / "shared" / "anchors" / ANCHOR_NAME,
                                             ROOT.parent.parent / "shared" / "anchors" / ANCHOR_NAME]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise FileNotFoundError(f"the anchor {ANCHOR_NAME} is not at {', '.join(map(str, candidates))}: carry .anchors "
                            "(a copy of shared/anchors) or pass --anchor PATH")


def load_anchor(path: str | Path | None = None):
    """The anchor script as a module (its main() does not run)."""
    p = find_anchor(path)
    spec = importlib.util.spec_from_file_location("hf_rl_step", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Rollouts:
    prompts: list[int]  # P per sequence
    responses: list[int]  # R per sequence
    seqs: list[np.ndarray]  # [P + R] int64 each

    @property
    def real_tokens(self) -> int:  # the anchor's count: prompt + response tokens, no padding
        return sum(self.prompts) + sum(self.responses)

    @property
    def response_tokens(self) -> int:
        return sum(self.responses)

    @property
    def longest(self) -> int:
        return max(len(s) for s in self.seqs)

    def summary(self) -> dict:
        """The fields of the anchor's `"part": "A"` line that pin the data down (compared, must be equal)."""
        return dict(n=len(self.seqs), real_tokens=self.real_tokens, prompt_tokens=sum(self.prompts),
                    response_tokens=self.response_tokens, resp_median=float(np.median(self.responses)),
                    resp_max=max(self.responses), resp_min=min(self.responses), longest_seq=self.longest)


def make_rollouts(vocab: int, n: int = 64, seed: int = 1234, scale: float = 1.0, anchor=None) -> Rollouts:
    mod = anchor if anchor is not None and not isinstance(anchor, (str, Path)) else load_anchor(anchor)
    P, R, seqs = mod.make_rollouts(n, seed, vocab, scale)
    return Rollouts(list(P), list(R), [s.numpy().astype(np.int64) for s in seqs])


def same_data(ours: Rollouts, anchor_line: dict) -> tuple[bool, dict]:
    """(equal, the differing fields) between our summary and the anchor's own "A" line."""
    mine = ours.summary()
    diff = {k: (v, anchor_line.get(k)) for k, v in mine.items() if k in anchor_line and anchor_line[k] != v}
    return not diff and all(k in anchor_line for k in mine), diff


def token_budget(r: Rollouts, multiple: int = 128) -> int:
    """T: the longest sequence rounded up to `multiple` (the anchor's pack_flex row length; shardfit needs T >= the
    longest datum)."""
    return int(math.ceil(r.longest / multiple) * multiple)


def response_slice(p: int, r: int) -> slice:
    """Positions of a datum (tokens = s[:-1]) whose targets are the response tokens."""
    return slice(p - 1, p + r - 1)


def to_datums(r: Rollouts, old: list[np.ndarray] | None = None, adv: list[np.ndarray] | None = None) -> list:
    """Datums for Engine.forward (old is None: target_tokens and mask only) or for ppo (old, adv: [R] per sequence,
    the response tokens' sampler log-probs and advantages)."""
    from shardfit.rl import make_datum

    out = []
    for i, (p, n, s) in enumerate(zip(r.prompts, r.responses, r.seqs)):
        L = len(s) - 1
        resp = response_slice(p, n)
        mask = np.zeros(L, np.float32)
        mask[resp] = 1.0
        inputs = {"target_tokens": s[1:], "mask": mask}
        if old is not None:
            lp, a = np.zeros(L, np.float32), np.zeros(L, np.float32)
            lp[resp], a[resp] = old[i], adv[i]
            inputs.update(logprobs=lp, advantages=a)
        out.append(make_datum(s[:-1], **inputs))
    return out


def response_logprobs(r: Rollouts, outputs: list[dict]) -> list[np.ndarray]:
    """[R] per sequence: the response tokens' log-probs out of Engine.forward's per-datum [L] outputs."""
    return [np.asarray(o["logprobs"], np.float32)[response_slice(p, n)]
            for o, p, n in zip(outputs, r.prompts, r.responses)]


def sampler_inputs(r: Rollouts, logprobs: list[np.ndarray], seed: int = 7, noise: float = 0.1):
    """(old, adv) as the anchor makes them: old = recomputed log-probs + N(0, noise^2) (a sampler that disagrees a
    little), advantages N(0, 1) per response token. numpy's generator: the values differ from the anchor's torch
    ones, their distribution (and so the clip fraction's scale) does not."""
    g = np.random.default_rng(seed)
    old = [(lp + noise * g.standard_normal(len(lp))).astype(np.float32) for lp in logprobs]
    adv = [g.standard_normal(n).astype(np.float32) for n in r.responses]
    return old, adv


def to_tinker(datums: list) -> list:
    """The same datums in the tinker SDK's types (what an RL loop sends through `shardfit serve`)."""
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(d.tokens.tolist()),
                        loss_fn_inputs={k: (v.astype(np.int64) if k == "target_tokens" else v.astype(np.float32))
                                        for k, v in d.inputs.items()})
            for d in datums]
