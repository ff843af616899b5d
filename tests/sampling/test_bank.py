"""The LoRA rows interface as the Sampler drives it: before every forward, bank.set_rows(slots) with the forward's
input shape and each token's adapter slot, so that rows of different adapters decode in one batch each with its
own. The bank here is a stand-in: it shifts each token's embedding by its slot (a real one, sampling/lora_bank.py,
adds each row's LoRA)."""

import pytest
import torch

from shardfit.errors import ShardfitError
from shardfit.sampling import Sampler, SampleRequest, SamplingParams


class ShiftBank:
    n_slots = 2

    def __init__(self, model):
        self.calls: list[tuple[tuple, torch.Tensor]] = []
        self.slots = None
        model.model.embed_tokens.register_forward_hook(self._shift)
        model.lm_head.register_forward_pre_hook(self._check_head)
        self.heads = 0

    def set_rows(self, slots: torch.Tensor) -> None:
        self.slots = slots.clone()
        self.calls.append(tuple(slots.shape))

    def _check_head(self, module, args):
        """A bank that adapts the head reads the rows too: its input [B, S, D] is the shape set_rows was told."""
        assert tuple(self.slots.shape) == tuple(args[0].shape[:-1]), (self.slots.shape, args[0].shape)
        self.heads += 1

    def _shift(self, module, args, out):
        assert self.slots is not None and tuple(self.slots.shape) == tuple(args[0].shape)
        return out + 0.5 * (self.slots + 1)[..., None].to(out.dtype)


def _req(adapter, seed=3):
    prompt = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    return SampleRequest(prompt, SamplingParams(10, temperature=1.0, seed=seed), num_samples=2, adapter=adapter,
                         prompt_logprobs=True)


def test_rows_of_different_adapters_decode_in_one_batch_each_with_its_own():
    from tests.sampling.tiny import tiny_model

    model = tiny_model(seed=1)
    bank = ShiftBank(model)
    mixed = Sampler(model, block_size=4, bank=bank).run([_req(0), _req(-1), _req(1)])
    assert bank.calls and all(len(shape) == 2 for shape in bank.calls) and bank.heads > 10
    assert any(shape[1] == 1 and shape[0] == 6 for shape in bank.calls)  # the decode step of the 6 rows
    alone = [Sampler(model, block_size=4, bank=bank).run([_req(a)])[0] for a in (0, -1, 1)]
    tokens = [[s.tokens for s in r.samples] for r in mixed]
    assert tokens == [[s.tokens for s in r.samples] for r in alone]
    assert len({str(t) for t in tokens}) == 3  # the same prompt and seed: three adapters, three answers
    with pytest.raises(ShardfitError) as e:
        Sampler(model, bank=bank).submit(_req(2))
    assert str(e.value).startswith("adapter: adapter slot 2 is not served here")


def test_sampler_arguments_are_checked():
    from tests.sampling.tiny import tiny_model

    model = tiny_model()
    for kw, line in ((dict(block_size=0), "Sampler(block_size=...): block_size=0 is out of range"),
                     (dict(attention="paged"), "Sampler(attention=...): attention='paged' is not a paged attention"),
                     (dict(kv_fraction=1.5), "Sampler(kv_fraction=...): kv_fraction=1.5 is outside (0, 1]")):
        with pytest.raises(ShardfitError) as e:
            Sampler(model, **kw)
        assert str(e.value).startswith(line), str(e.value)
