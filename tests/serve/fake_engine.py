"""A one-process stand-in for the Engine's RL API (the names serve/ codes against), on the real tiny model.

It computes what the Engine computes where the server can tell: per-token log-probs of the targets, cross_entropy as
the weighted sum of -logp (never renormalised), AdamW steps (skipped, as the Engine skips them, when the gradient
norm is not finite), saved and loaded state (written through a Python file under a temporary name, then renamed:
as DCP writes, a full disk surfaces as the OSError inside the writer's RuntimeError). Anything else is refused with a
ShardfitError, as the Engine refuses it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from shardfit.config import load_config
from shardfit.engine.optim import AdamParams  # the real step's hyperparameters: Tinker's names and defaults
from shardfit.errors import ShardfitError
from shardfit.models import build_model


@dataclass
class Datum:
    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardResult:
    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


RL_TYPES = (Datum, AdamParams)


def tiny_config(tmp_path: Path, *overrides: str):
    return load_config(None, [f"--logging.run_dir={tmp_path / 'run'}", "--model.max_seq_len=128",
                              "--data.seq_len=128", *overrides])


class FakeEngine:
    def __init__(self, cfg):
        self.cfg = cfg
        self.dist = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
        self.model = build_model(cfg.model)
        self.model.init_weights(seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.step = 0
        self.calls: list[str] = []

    def _logprobs(self, d: Datum) -> torch.Tensor:
        logits = self.model(torch.as_tensor(d.tokens)[None])[0].float()
        target = torch.as_tensor(d.inputs["target_tokens"])
        return torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1)

    def _run(self, datums, loss_fn, backward: bool) -> ForwardBackwardResult:
        if loss_fn != "cross_entropy":
            raise ShardfitError(f"unknown loss_fn '{loss_fn}'", where="loss_fn", fix="use cross_entropy")
        outputs, total = [], 0.0
        for d in datums:
            if int(d.tokens.max()) >= self.cfg.model.vocab_size:
                raise ShardfitError("token id beyond the vocabulary", where="tokens", fix="use the tokenizer")
            lp = self._logprobs(d)
            w = torch.as_tensor(d.inputs.get("weights", np.ones(len(d.tokens), np.float32)))
            loss = -(w * lp).sum()
            if backward:
                loss.backward()
            total += float(loss.detach())
            outputs.append({"logprobs": lp.detach().numpy().astype(np.float32)})
        return ForwardBackwardResult(outputs, {"loss:sum": total})

    def datum_budget(self) -> int:  # the Engine's: train.micro_batch_tokens, else data.seq_len x train.micro_batch
        t = self.cfg.train
        return t.micro_batch_tokens or self.cfg.data.seq_len * max(t.micro_batch, 1)

    def sample(self, prompts, params, *, model=None, version=None, num_samples=1, prompt_logprobs=False,
               topk_prompt_logprobs=0, topk_sample_logprobs=0, tokenizer=None, refused="raise"):
        """Engine.sample's call as serve makes it (options one per prompt), through the real Sampler over this model's
        live weights (the fake holds no versions: model and version are ignored)."""
        from shardfit.sampling.params import SampleRequest
        from shardfit.sampling.runner import Sampler

        self.calls.append("sample")
        reqs = [SampleRequest(list(p), *opts) for p, *opts in zip(prompts, params, num_samples, [-1] * len(prompts),
                                                                      prompt_logprobs, topk_prompt_logprobs,
                                                                      topk_sample_logprobs)]
        self.model.eval()
        try:
            return Sampler(self.model, kv_blocks=64, block_size=16, tokenizer=tokenizer, cuda_graphs=False).run(reqs)
        finally:
            self.model.train()

    def forward(self, datums, loss_fn="cross_entropy", loss_fn_config=None):
        self.calls.append("forward")
        with torch.no_grad():
            return self._run(datums, loss_fn, False)

    def forward_backward(self, datums, loss_fn="cross_entropy", loss_fn_config=None):
        self.calls.append("forward_backward")
        return self._run(datums, loss_fn, True)

    def optim_step(self, p: AdamParams) -> dict[str, float]:
        self.calls.append("optim_step")
        for g in self.opt.param_groups:
            g.update(lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.grad_clip_norm or float("inf")))
        if math.isfinite(norm):
            self.opt.step()
        self.opt.zero_grad()
        self.step += 1
        return {"grad_norm:mean": norm, "skipped:max": float(not math.isfinite(norm))}

    def save_state(self, path: Path, optimizer: bool = True) -> Path:
        self.calls.append("save_state")
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / "state.pt.tmp"
        try:
            with open(tmp, "wb") as f:
                torch.save({"model": self.model.state_dict(), **({"opt": self.opt.state_dict()} if optimizer else {})},
                           f)
            os.replace(tmp, path / "state.pt")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def load_state(self, path: Path, optimizer: bool = True) -> None:
        self.calls.append("load_state")
        state = torch.load(path / "state.pt", weights_only=True)
        self.model.load_state_dict(state["model"])
        if optimizer and "opt" in state:
            self.opt.load_state_dict(state["opt"])

    def load_version(self, path: Path, name: str = "") -> str:
        """Engine.load_version's call: the fake holds no versions, so a sampler of a saved path is refused as the
        Engine refuses what it cannot load (a user error), never a silent sample of the live weights."""
        self.calls.append("load_version")
        raise ShardfitError("the fake Engine holds no versions", where=name or str(path),
                            fix="sample a saved path on the real Engine")
