"""engine/preference.py: the pair losses' values at known points (ORPO and KTO against plain-torch forms of TRL's
formulas), and PairLoss's segment sums over a packed row (two pairs end to end; KTO's single examples; prompts and
padding not counted) equal the per-unit formula weighted 1/U, with its gradient reaching only the counted tokens."""

from __future__ import annotations

import math

import pytest
import torch

from shardfit.engine.batch import DeviceBatch
from shardfit.engine.preference import BatchTerms, PairLoss, PairObjective, log1mexp, pair_loss


def test_pair_losses_at_known_points():
    s = torch.tensor([[-3.0, -5.0]], dtype=torch.float64)  # chosen, rejected sums
    r = torch.tensor([[-4.0, -4.0]], dtype=torch.float64)
    n = torch.tensor([[2.0, 4.0]], dtype=torch.float64)
    loss, rewards = pair_loss(PairObjective("dpo", beta=0.5), s, r, n)
    h = 0.5 * ((-3 + 4) - (-5 + 4))  # beta x margin = 1
    assert float(loss) == pytest.approx(math.log1p(math.exp(-h)))
    assert rewards.tolist() == [[0.5, -0.5]]
    loss, _ = pair_loss(PairObjective("dpo", beta=0.5, label_smoothing=0.2), s, r, n)
    assert float(loss) == pytest.approx(0.8 * math.log1p(math.exp(-h)) + 0.2 * math.log1p(math.exp(h)))
    loss, rewards = pair_loss(PairObjective("ipo", beta=0.25), s, r, n)
    margin = (-3 + 4) / 2 - (-5 + 4) / 4  # per-token means
    assert float(loss) == pytest.approx((margin - 2.0) ** 2) and rewards.tolist() == [[0.125, -0.0625]]
    loss, rewards = pair_loss(PairObjective("simpo", beta=2.0, gamma=0.5), s, None, n)
    g = 2.0 * (-3 / 2 - -5 / 4) - 0.5
    assert float(loss) == pytest.approx(math.log1p(math.exp(-g))) and rewards.tolist() == [[-3.0, -2.5]]


class _Head(torch.nn.Module):
    """Stands in for the model: the log-probs are a parameter, so their gradient is the loss's per-token one."""

    def __init__(self, logp: torch.Tensor):
        super().__init__()
        self.logp = torch.nn.Parameter(logp.clone())

    def forward(self, *args, **kwargs):
        return self.logp[None], None

    def router_aux_term(self, weight):
        return None


def test_pair_loss_sums_each_sequence_of_the_row():
    # one [1, 12] row: pair 0 (datums 0, 1) and pair 1 (datums 2, 3) of a global list of 3 pairs, then padding
    datum = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, -1, -1], dtype=torch.float32)
    counted = torch.tensor([0, 1, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)  # prompts: the first token
    P = 3
    coef = torch.zeros(12)
    for k in (0, 1):
        members = counted & ((datum == 2 * k) | (datum == 2 * k + 1))
        coef[members] = 1.0 / (P * int(members.sum()))
    logp = -torch.arange(1.0, 13.0) / 4
    ref = torch.full((12,), -1.0)
    b = DeviceBatch(torch.zeros(1, 12, dtype=torch.long), torch.zeros(1, 12, dtype=torch.long), None, None, coef,
                    {"datum": datum, "ref_logprobs": ref}, None)
    head = _Head(logp)
    obj = PairObjective("dpo", beta=0.3)
    total, out = PairLoss(obj, 2 * P)(head, b)
    seq = lambda d, x: x[counted & (datum == d)].sum()  # noqa: E731
    want = sum(pair_loss(obj, torch.stack([seq(2 * k, logp), seq(2 * k + 1, logp)])[None],
                         torch.stack([seq(2 * k, ref), seq(2 * k + 1, ref)])[None],
                         torch.ones(1, 2))[0][0] / P for k in (0, 1))
    assert total.item() == pytest.approx(float(want), rel=1e-6)
    assert torch.allclose(out["logprobs"], logp)
    total.backward()
    assert torch.all(head.logp.grad[~counted] == 0) and torch.all(head.logp.grad[counted] != 0)


def test_orpo_and_kto_equal_plain_torch_formulas():
    # ORPO (Hong et al., TRL's ORPOTrainer): NLL of the chosen answers over their tokens, minus lambda x the mean
    # log-sigmoid of the log odds ratio of the per-token means; KTO (TRL's KTOTrainer): the mean over examples of
    # w (1 - sigmoid(beta (ratio - z))) for desirable ones and w (1 - sigmoid(beta (z - ratio))) for the others
    s = torch.tensor([[-3.0, -5.0], [-8.0, -2.0]], dtype=torch.float64)  # two pairs
    n = torch.tensor([[2.0, 4.0], [5.0, 1.0]], dtype=torch.float64)
    obj = PairObjective("orpo", beta=0.2)
    loss, rewards = pair_loss(obj, s, None, n, BatchTerms(nll_share=2 / 7))
    m = s / n
    log_odds = (m[:, 0] - m[:, 1]) - (torch.log(1 - torch.exp(m[:, 0])) - torch.log(1 - torch.exp(m[:, 1])))
    want = -(s[0, 0] + s[1, 0]) / 7 - 0.2 * torch.log(torch.sigmoid(log_odds)).mean()
    assert float(loss.mean()) == pytest.approx(float(want), rel=1e-12)
    assert torch.allclose(rewards, 0.2 * m)
    assert float(log1mexp(torch.tensor(-1e-9))) == pytest.approx(math.log(1 - math.exp(-1e-6)))  # clamped: finite

    s1 = torch.tensor([[-3.0], [-5.0], [-9.0]], dtype=torch.float64)
    r1 = torch.tensor([[-4.0], [-4.0], [-8.5]], dtype=torch.float64)
    good = torch.tensor([True, False, True])
    obj = PairObjective("kto", beta=0.5, desirable_weight=1.5, undesirable_weight=0.7)
    loss, rewards = pair_loss(obj, s1, r1, torch.ones(3, 1), BatchTerms(kl=0.25, desirable=good))
    ratio = (s1 - r1)[:, 0]
    want = [1.5 * (1 - torch.sigmoid(0.5 * (ratio[0] - 0.25))), 0.7 * (1 - torch.sigmoid(0.5 * (0.25 - ratio[1]))),
            1.5 * (1 - torch.sigmoid(0.5 * (ratio[2] - 0.25)))]
    assert torch.allclose(loss, torch.stack(want)) and torch.allclose(rewards[:, 0], 0.5 * ratio)


def test_kto_loss_sums_each_example_of_the_row():
    # KTO's units are single sequences: one [1, 8] row holds examples 0 and 2 of a global list of 4, then padding
    datum = torch.tensor([0, 0, 0, 2, 2, 2, -1, -1], dtype=torch.float32)
    counted = torch.tensor([0, 1, 1, 0, 1, 1, 0, 0], dtype=torch.bool)
    coef = torch.zeros(8)
    for d in (0, 2):
        members = counted & (datum == d)
        coef[members] = 1.0 / (4 * int(members.sum()))
    logp, ref = -torch.arange(1.0, 9.0) / 3, torch.full((8,), -1.2)
    b = DeviceBatch(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long), None, None, coef,
                    {"datum": datum, "ref_logprobs": ref}, None)
    head = _Head(logp)
    obj = PairObjective("kto", beta=0.4)
    good = torch.tensor([True, True, False, False])
    total, _ = PairLoss(obj, 4, BatchTerms(kl=0.1, desirable=good))(head, b)
    ratio = {d: float((logp - ref)[counted & (datum == d)].sum()) for d in (0, 2)}
    want = ((1 - torch.sigmoid(torch.tensor(0.4 * (ratio[0] - 0.1))))
            + (1 - torch.sigmoid(torch.tensor(0.4 * (0.1 - ratio[2]))))) / 4
    assert total.item() == pytest.approx(float(want), rel=1e-6)
    total.backward()
    assert torch.all(head.logp.grad[~counted] == 0) and torch.all(head.logp.grad[counted] != 0)
