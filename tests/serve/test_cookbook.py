"""tinker-cookbook 0.6.1's own loops against `shardfit serve`, not copies of their calls.

issue 35's DPO row: preference/train_dpo.py's
create_dpo_clients (the training client, then its reference from save_weights_and_get_sampling_client) and do_update
(the reference's log-probs of every chosen and rejected sequence through compute_logprobs' coroutine, the DPO loss
through forward_backward_custom, optim_step, the cookbook's metrics log) against `shardfit serve --lora.rank=8`
(one gloo rank, CPU); then its checkpoints as its loops keep them (CheckpointManager every 2 steps: state with the
optimizer and sampler weights, with a ttl) read back three ways: its resume (get_last_checkpoint,
create_training_client_from_state_with_optimizer), a new run from them (load_checkpoint_path:
create_training_client_from_state), and a sampler of the saved sampler path.

The cookbook is not in the test extra: 0.6.1 requires tml-renderers>=0.4.1, which the package index here lacks, so
`pip install tinker-cookbook` fails; the module imports without it (`pip install --no-deps tinker-cookbook==0.6.1
chz blobfile cloudpickle pyrage tiktoken termcolor datasets dill multiprocess xxhash pandas lxml` into a directory on
PYTHONPATH). Skipped where it is absent; tests/serve/test_models.py's _dpo keeps the same calls covered in the
default run.

The RL step: rl/train.py's train_step, which pipelines its substeps (the next forward_backward and optim_step
enqueued before the current results are read), trains a model exactly as the same calls made one after another,
each awaited, train another of the same seed; then completers.py's TinkerTokenCompleter (the RL loops' policy)
samples an action whose log-probs are those compute_logprobs gives the same tokens, with its sequence_id.

SFT: supervised/train.py's main, whole and unchanged (its own ServiceClient from base_url and TINKER_API_KEY, the
tokenizer loaded by model_name, pipelined batches, checkpoints, metrics), against a server started with
--model.path on a checkpoint with a tokenizer: its first step's mean NLL is transformers' on that checkpoint.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook.preference.train_dpo")

from tests._dist import run_ranks  # noqa: E402
from tests.serve.engine_server import datums, dpo_pairs, logprobs, scored, serve  # noqa: E402
from tests.serve.test_models import ARGS  # noqa: E402

STEPS = 4


class _Bytes:
    """The tokenizer do_update prints its first batch with (tokens are bytes here)."""

    def decode(self, ids, **_):
        return bytes(int(i) % 256 for i in ids).decode("latin-1")


def _cookbook_dpo(sc, url: str, base_model: str, log_dir: str) -> dict:
    import chz
    from tinker import types
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.supervised.types import SupervisedDataset
    from tinker_cookbook.utils import ml_log

    seqs, data = dpo_pairs()

    class Pairs(SupervisedDataset):
        def get_batch(self, index: int):
            return data

        def __len__(self) -> int:
            return STEPS

    # 1e-2: with the cookbook's Adam beta2 of 0.95, 5e-2 overshoots within 4 steps on these two pairs
    cfg = train_dpo.Config(log_path=log_dir, model_name=base_model, recipe_name="shardfit-test",
                           dataset_builder=None, lora_rank=8, learning_rate=1e-2, lr_schedule="constant",
                           eval_every=0, infrequent_eval_every=0, save_every=0, base_url=url)
    meta: dict[str, str] = {}
    checkpoint_utils.add_renderer_name_to_user_metadata(meta, "llama3")  # what the cookbook's main sends
    policy, reference = train_dpo.create_dpo_clients(cfg, sc, user_metadata=meta)
    log = ml_log.setup_logging(log_dir, config=None, do_configure_logging_module=False)
    # the cookbook's checkpoints: state (with the optimizer) and sampler weights every 2 steps, with its ttl
    saves = checkpoint_utils.CheckpointManager(policy, sc, log_dir, save_every=2, ttl_seconds=3600)
    probe = types.ModelInput.from_ints(seqs[0])  # the first chosen sequence
    out = {"ref": [], "policy": []}
    for step in range(STEPS):
        out["ref"].append(reference.compute_logprobs(probe).result())
        out["policy"].append(policy.save_weights_and_get_sampling_client().result().compute_logprobs(probe).result())
        train_dpo.do_update(0, step, STEPS, STEPS, cfg, policy, reference, [], [], Pairs(), log, log_dir, _Bytes(),
                            checkpoint_mgr=saves)
    log.close()
    # the cookbook's resume: its last record's state with the optimizer; its reference becomes the resumed weights
    last = checkpoint_utils.get_last_checkpoint(log_dir)
    out["resumed_batch"] = last.batch
    out["renderer"] = checkpoint_utils.get_renderer_name_from_checkpoint(sc, last.state_path)  # its resume check
    _, resumed = train_dpo.create_dpo_clients(cfg, sc, last)
    out["resumed"] = resumed.compute_logprobs(probe).result()
    # a fresh DPO run from that checkpoint (load_checkpoint_path: the weights, a new optimizer)
    _, started = train_dpo.create_dpo_clients(chz.replace(cfg, load_checkpoint_path=last.state_path), sc)
    out["started_from"] = started.compute_logprobs(probe).result()
    saved = sc.create_sampling_client(model_path=last.sampler_path).result()
    out["sampler_path"] = saved.compute_logprobs(probe).result()
    out["metrics"] = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    return out


def _rl_step(sc, url: str, base_model: str) -> dict:
    import asyncio

    from tinker import types
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.rl.train import train_step

    rng = np.random.default_rng(3)
    data = []
    for d in datums(5, n=4):  # the cookbook's RL datum: the sampler's log-probs and the advantages beside the tokens
        n = len(d.loss_fn_inputs["target_tokens"].to_numpy())
        data.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"].to_numpy(),
            "logprobs": rng.normal(-5.0, 0.5, n).astype(np.float32),
            "advantages": rng.normal(0.0, 1.0, n).astype(np.float32)}))
    piped, plain, fresh = (sc.create_lora_training_client(base_model=base_model, rank=8, seed=11).result()
                           for _ in "abc")
    got = asyncio.run(train_step(data, piped, 1e-2, 2, "importance_sampling"))
    want = []
    adam = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)  # train_step's
    for half in (data[:2], data[2:]):
        want += [o["logprobs"].to_numpy().tolist()
                 for o in plain.forward_backward(half, "importance_sampling").result().loss_fn_outputs]
        plain.optim_step(adam).result()
    untrained = [o["logprobs"].to_numpy().tolist()
                 for o in fresh.forward(data[2:], "importance_sampling").result().loss_fn_outputs]
    # the cookbook's RL policy: TinkerTokenCompleter samples one action with its log-probs and provenance
    sampler = piped.save_weights_and_get_sampling_client().result()
    action = asyncio.run(TinkerTokenCompleter(sampler, max_tokens=6, temperature=1.0)(data[0].model_input, stop=[]))
    prompt = data[0].model_input.to_ints()
    scored_again = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + list(action.tokens))).result()
    return {"piped": [t.tolist() for t in got], "plain": want, "after": [logprobs(piped), logprobs(plain)],
            "untrained": untrained, "action": [list(action.tokens), list(action.logprobs), action.stop_reason,
                                               action.sequence_id], "scored": scored_again[len(prompt):]}


def test_the_cookbook_s_pipelined_rl_step_trains_as_the_same_calls_one_by_one(tmp_path):
    r = run_ranks(functools.partial(serve, scenario=_rl_step, args=ARGS), 1, str(tmp_path / "run"), timeout=300)[0]
    assert r["piped"] == r["plain"]  # the second substep's log-probs: after the first optim_step, in both
    assert r["after"][0] == r["after"][1]
    assert r["piped"][2:] != r["untrained"]  # the second substep ran after the first one's optim_step
    tokens, lps, stop_reason, sequence_id = r["action"]
    assert len(tokens) == len(lps) == 6 and stop_reason == "length" and sequence_id  # provenance for stable_reinforce
    np.testing.assert_allclose(lps, r["scored"], rtol=0, atol=1e-4)  # the sampled tokens' log-probs, as scored


@pytest.mark.parametrize("base", ["bf16", "fp8"])
def test_the_cookbook_s_own_dpo_loop_keeps_its_reference_frozen(tmp_path, base):
    """On an FP8 base too (model.quantize=fp8): its reference is a sampling client of the FP8 base (the sampler's
    layers in FP8, sampling/source.py), whose log-probs equal the policy's forward but for an activation's e4m3 code
    flipped by fp32 rounding."""
    dpo = functools.partial(_cookbook_dpo, log_dir=str(tmp_path / "log"))
    args = [*ARGS, "--model.quantize=fp8"] if base == "fp8" else ARGS
    r = run_ranks(functools.partial(serve, scenario=dpo, args=args), 1, str(tmp_path / "run"), timeout=300)[0]
    assert all(ref == r["ref"][0] for ref in r["ref"])  # exactly: the frozen version, whatever trained since
    assert r["policy"][0] == r["ref"][0]  # a new model starts at its reference
    assert r["policy"][-1] != r["policy"][0]  # and moved
    losses = [m["dpo_loss"] for m in r["metrics"] if "dpo_loss" in m]
    assert len(losses) == STEPS
    # policy == reference at step 0: -logsigmoid(0)
    assert losses[0] == pytest.approx(np.log(2), abs=1e-6 if base == "bf16" else 1e-3)
    assert losses[-1] < losses[0]
    assert r["metrics"][-1]["accuracy"] == 1.0 and r["metrics"][-1]["margin"] > 0
    # the checkpoint saved before step 2's update holds the weights after 2 updates: both of its paths give them
    assert r["resumed_batch"] == 2 and r["resumed"] == r["policy"][2] and r["sampler_path"] == r["policy"][2]
    assert r["started_from"] == r["policy"][2]
    assert r["renderer"] == "llama3"  # the run's user_metadata, read back through the REST listing of its path


def _hf_dir_with_tokenizer(root: Path) -> str:
    """A tiny Llama checkpoint with a tokenizer transformers loads (one word a token id: "t17" is id 17): what the
    cookbook's main needs to find under the model name it is given (get_tokenizer(model_name))."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)).save_pretrained(root)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", bos_token="t2",
                                         unk_token="t0").save_pretrained(root)
    return str(root)


def _cookbook_sft(sc, url: str, base_model: str, log_dir: str) -> dict:
    """supervised/train.py's main, whole: its own ServiceClient (base_url), LoRA client, tokenizer by model_name,
    pipelined batches, checkpoints, metrics; 3 batches of datums(100 + i)."""
    import asyncio
    import os

    import chz
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder

    class Batches(SupervisedDataset):
        def get_batch(self, index: int):
            return datums(100 + index, n=4)

        def __len__(self) -> int:
            return 3

    @chz.chz
    class Builder(SupervisedDatasetBuilder):
        def __call__(self):
            return Batches(), None

    os.environ["TINKER_API_KEY"] = "tml-local"  # its ServiceClient reads the key from the environment
    cfg = train.Config(log_path=log_dir, model_name=base_model, recipe_name="shardfit-test", dataset_builder=Builder(),
                       learning_rate=1e-2, lora_rank=8, base_url=url, save_every=2, eval_every=0,
                       infrequent_eval_every=0)
    asyncio.run(train.main(cfg))
    records = [json.loads(line) for line in (Path(log_dir) / "checkpoints.jsonl").read_text().splitlines()]
    final = sc.create_sampling_client(model_path=records[-1]["sampler_path"]).result()
    return {"metrics": [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()],
            "checkpoints": records, "final": scored(final),
            "base": scored(sc.create_sampling_client(base_model=base_model).result())}


def test_the_cookbook_s_supervised_main_runs_whole_and_starts_from_the_base(tmp_path):
    import torch
    import transformers

    model_dir = _hf_dir_with_tokenizer(tmp_path / "model")
    sft = functools.partial(_cookbook_sft, log_dir=str(tmp_path / "log"))
    args = ["--train.device=cpu", "--train.micro_batch_tokens=64", "--data.seq_len=64", "--lora.rank=8",
            f"--model.path={model_dir}"]
    r = run_ranks(functools.partial(serve, scenario=sft, args=args), 1, str(tmp_path / "run"), timeout=300)[0]
    nll = [m["train_mean_nll"] for m in r["metrics"] if "train_mean_nll" in m]
    assert len(nll) == 3
    # step 0 trains from the base (LoRA B = 0): its mean NLL is transformers' on the checkpoint, the same datums
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total = count = 0.0
    with torch.no_grad():
        for d in datums(100, n=4):
            ids = torch.tensor([d.model_input.to_ints()])
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            total -= float(lp.gather(-1, torch.as_tensor(d.loss_fn_inputs["target_tokens"].to_numpy())[:, None]).sum())
            count += ids.shape[1]
    assert nll[0] == pytest.approx(total / count, rel=1e-5)
    names = [c["name"] for c in r["checkpoints"]]
    assert names == ["000002", "final"] and all(c["state_path"] and c["sampler_path"] for c in r["checkpoints"])
    assert r["final"] != r["base"]  # the final sampler holds the trained adapters
