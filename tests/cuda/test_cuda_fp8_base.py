"""An FP8 base on CUDA (model.quantize=fp8): quantisation on the GPU equals the CPU's bit for bit (a multiplication,
one fp32 division and a rounding cast per value; compiled, Triton's approximate division may move a rare code by one
step; the operator's Triton kernel divides exactly and equals it), the FP8 tensor-core matmul (torch._scaled_mm,
rowwise scales) and its input gradient agree with the CPU's emulation of the same arithmetic, the tiny model trains
on an FP8 base under compile and selective checkpointing on NCCL, its codes unchanged, and the sampler decodes an
FP8 base inside CUDA graphs as eagerly."""

import pytest
import torch

from shardfit.adapters.fp8_base import FP8Linear, fp8_linear, quantize_rows_fp8
from shardfit.adapters.quantized import to_dtype, to_quantized
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import same_bits, small_config

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")]

FP8 = ["--train.device=cuda", "--lora.rank=8", "--lora.alpha=16", "--train.steps=20", "--train.lr=3e-3",
       "--data.seq_len=64", "--model.quantize=fp8"]


def test_cuda_quantisation_equals_the_cpu_one():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 4096, generator=gen) * torch.logspace(-4, 1, 96)[:, None]
    cpu = quantize_rows_fp8(w)
    gpu = quantize_rows_fp8(w.cuda())  # the weights' quantisation (eager): the CPU's codes, bit for bit
    assert torch.equal(gpu[0].view(torch.uint8).cpu(), cpu[0].view(torch.uint8))
    assert torch.equal(gpu[1].cpu(), cpu[1])
    # the activations' (compiled): the same scales; Triton's x / y is div.full (<= 2 ulp, Inductor's default), so a
    # quotient within 2 ulp of a rounding midpoint may take the neighbouring code
    codes, scales = torch.compile(quantize_rows_fp8, dynamic=True)(w.cuda())
    assert torch.equal(scales.cpu(), cpu[1])
    steps = (codes.float().cpu() - cpu[0].float()).abs() / (cpu[0].float().abs() * 2**-3).clamp_min(2**-9)
    assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-4


@pytest.mark.parametrize("k", [4096, 14336, 20000])  # held whole in registers (two widths) and looped over
def test_the_quantiser_and_transpose_kernels_equal_the_cpu_bit_for_bit(k):
    from shardfit.kernels.fp8_rows import quantize_rows, transpose_bytes

    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(257, k, generator=gen) * torch.logspace(-6, 2, 257)[:, None]).to(torch.bfloat16)
    x[3] = 0
    x[4] = torch.randn(k, generator=gen) * 1e-39  # bf16 subnormals: the kernel must not flush them (no .ftz)
    x[5, 7], x[6, 9] = float("nan"), float("inf")  # non-finite rows: NaN codes, as the CPU's (bits of NaN aside)
    col = torch.rand(k, generator=gen) * 3 + 1e-3  # dY's columns times the weight's row scales
    for cs in (None, col):
        want = quantize_rows_fp8(x, cs)  # the CPU's: IEEE division and a round-to-nearest-even cast
        got = quantize_rows(x.cuda(), None if cs is None else cs.cuda())  # div_rn and the hardware's cvt
        assert torch.equal(got[1].cpu(), want[1])
        got_codes, want_codes = got[0].float().cpu(), want[0].float()
        assert torch.equal(got_codes.isnan(), want_codes.isnan()) and want_codes[5:7].isnan().any(dim=1).all()
        fin = ~want_codes.isnan()  # a NaN's sign bit may differ; every other code bit for bit
        assert torch.equal(got[0].view(torch.uint8).cpu()[fin], want[0].view(torch.uint8)[fin])
    codes = want[0][:, :4096].contiguous().cuda()
    assert torch.equal(transpose_bytes(codes).view(torch.uint8), codes.view(torch.uint8).t().contiguous())


def test_the_tensor_core_matmul_and_its_input_gradient_agree_with_the_emulation():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 1024, bias=False)
    layer = to_dtype(to_quantized(lin, FP8Linear), torch.bfloat16)
    x = (torch.randn(300, 4096) * 2).to(torch.bfloat16)  # 300 tokens: no multiple of 16
    dy = torch.randn(300, 1024).to(torch.bfloat16)
    out = {}
    for dev in ("cpu", "cuda"):
        xd = x.to(dev).detach().requires_grad_(True)  # x.to("cpu") is x: without detach the CUDA copy was no leaf
        y = fp8_linear(xd, layer.weight_fp8.to(dev), layer.weight_scale.to(dev), 1024, 4096)
        y.backward(dy.to(dev))
        out[dev] = (y.float().cpu(), xd.grad.float().cpu())
    for got, want in zip(out["cuda"], out["cpu"]):
        # the same rounded operands; fp32 accumulation in another order, then one bf16 rounding each
        assert (got - want).norm() / want.norm() < 5e-3


def _train(rank, world, extra, run_dir):
    trainer = Trainer(small_config(*FP8, *extra, run_dir=run_dir))
    frozen = {n: p for n, p in trainer.model.named_parameters() if not p.requires_grad}
    before = {n: p.to_local().clone() for n, p in frozen.items()}
    history = trainer.fit()
    return {"losses": [h["loss"] for h in history],
            "codes_same": all(same_bits(before[n], p.to_local()) for n, p in frozen.items()),
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "notice": [n for n in trainer.engine.notices if "FP8 base" in n]}


@pytest.mark.parametrize("extra", [[], ["--compute.compile=true", "--compute.activation_checkpoint=selective"]],
                         ids=["eager", "compiled-selective"])
def test_lora_trains_on_an_fp8_base(tmp_path, extra):
    res = run_ranks(_train, 1, extra, str(tmp_path), backend="nccl")[0]
    # the LoRA CUDA test's bound (5.60 -> 5.27 over 20 steps, bf16 base): FP8's rounding must not stop learning
    assert res["losses"][-1] < res["losses"][0] - 0.15, res["losses"]
    assert res["codes_same"] and res["graph_breaks"] == 0 and res["notice"]


def test_the_sampler_decodes_an_fp8_base_in_cuda_graphs_as_eagerly():
    """A decode model whose linear layers are FP8 (their _scaled_mm and Triton quantiser captured in the decode
    step's CUDA graphs): the same tokens as the eager step."""
    from shardfit.adapters.fp8_base import FP8Linear
    from shardfit.adapters.quantized import apply_quantized
    from shardfit.sampling import Sampler, SampleRequest, SamplingParams
    from tests.sampling.tiny import tiny_model

    model = tiny_model().cuda().to(torch.bfloat16)
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n.startswith("model.layers.")]
    assert apply_quantized(model, names, FP8Linear) == 14
    reqs = [SampleRequest(list(range(3 + i, 12 + 2 * i)), SamplingParams(12, temperature=0.0 if i % 2 else 1.0,
                                                                          seed=i), num_samples=1 + i % 3)
            for i in range(8)]
    run = lambda graphs: [[s.tokens for s in r.samples]  # noqa: E731
                          for r in Sampler(model, kv_blocks=128, block_size=16, cuda_graphs=graphs).run(reqs)]
    eager = run(False)
    assert run(True) == eager
