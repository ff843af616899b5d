"""shardfit generate on a GPU: the tokens transformers' generate gives on the same GPU (fp32, greedy)."""

import pytest
import torch

from shardfit.cli.generate import decode
from shardfit.weights.local import load_hf

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_tokens_on_cuda_match_transformers(tmp_path, kind):
    from tests.cli.test_generate import _save

    path, hf = _save(kind, tmp_path)
    cuda = torch.device("cuda")
    model, _ = load_hf(str(path), cuda, torch.float32)
    assert next(model.parameters()).is_cuda
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = decode(model, [prompt], 30)[0]
    theirs = hf.to(cuda).generate(torch.tensor([prompt], device=cuda), max_new_tokens=30, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs and len(set(ours)) > 1
