"""shardfit generate: the same tokens as transformers' generate (through the Sampler, and through the reference loop
with --no-cache), seeded sampling within the nucleus, the chat template as transformers applies it, and a DCP
checkpoint that generates what its export does."""

import json

import pytest
import torch

from shardfit.cli.generate import decode, prompt_ids
from shardfit.cli.generate import generate as main
from shardfit.models import build_model
from shardfit.weights.local import load_dcp, load_hf

transformers = pytest.importorskip("transformers")
SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
}
CPU = torch.device("cpu")


def _save(kind, tmp_path):
    torch.manual_seed(0)
    hf = FAMILIES[kind]().eval()
    hf.save_pretrained(tmp_path / kind)
    return tmp_path / kind, hf


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_greedy_tokens_match_transformers_generate(tmp_path, kind):
    path, hf = _save(kind, tmp_path)
    model, _ = load_hf(str(path), CPU, torch.float32)
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = decode(model, [prompt], 30)[0]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs == decode(model, [prompt], 30, use_cache=False)[0]
    assert len(set(ours)) > 1  # a real sequence, not one repeated token that any bug could also produce


def test_bf16_generation_keeps_fp32_rope_frequencies(tmp_path):
    """Training casts parameters only; a bf16 copy of inv_freq would move angles by ~0.7 rad at position 4,000."""
    from shardfit.models.decoder import rope_inv_freq

    path, _ = _save("llama", tmp_path)
    model, _ = load_hf(str(path), CPU, torch.bfloat16)
    inv = model.model.inv_freq
    assert inv.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(inv, rope_inv_freq(model.cfg, model.model.head_dim))


def test_sampling_is_seeded_and_stays_in_the_nucleus(tmp_path):
    path, _ = _save("llama", tmp_path)
    model, _ = load_hf(str(path), CPU, torch.float32)
    prompt, other = list(range(10, 20)), list(range(40, 47))
    a = decode(model, [prompt], 20, temperature=1.0, top_p=0.9, seed=1)[0]
    assert a == decode(model, [other, prompt], 20, temperature=1.0, top_p=0.9, seed=1)[1]  # whatever else is asked
    assert a != decode(model, [prompt], 20, temperature=1.0, top_p=0.9, seed=2)[0]
    assert decode(model, [prompt], 20, temperature=1.0, top_p=1e-6, seed=1) == decode(model, [prompt], 20)


def _chat_tokenizer(tmp_path):
    """A small byte-level BPE tokenizer.json with ChatML special tokens and a chat template beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello there, how are you today? fine thanks"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    return tmp_path / "tokenizer.json", template


def test_chat_template_as_transformers_applies_it(tmp_path):
    from shardfit.data.tokenizer import build_tokenizer

    path, template = _chat_tokenizer(tmp_path)
    ours = prompt_ids(build_tokenizer(str(path)), str(path), "how are you?", raw=False)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), chat_template=template)
    theirs = hf_tok.apply_chat_template([{"role": "user", "content": "how are you?"}], add_generation_prompt=True,
                                        tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
    raw = prompt_ids(build_tokenizer(str(path)), str(path), "how are you?", raw=True)
    assert raw != ours and len(raw) < len(ours)


def test_dcp_checkpoint_generates_what_its_export_does(tmp_path, capsys):
    """Train briefly (checkpoint and float32 export of the same weights), then generate from both, through the CLI."""
    from shardfit.config import load_config
    from shardfit.parallel import shutdown_distributed
    from shardfit.train import Trainer

    run = tmp_path / "run"
    cfg = load_config(None, ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                             "--model.ffn_dim=64", "--data.seq_len=32", "--train.steps=3", "--train.device=cpu",
                             "--train.global_batch=4", "--train.micro_batch=4", "--logging.progress=none",
                             f"--logging.run_dir={run}", f"--checkpoint.export_hf={tmp_path / 'export'}",
                             "--checkpoint.export_dtype=float32"])
    try:
        Trainer(cfg).fit()
    finally:
        shutdown_distributed()
    from_ckpt, tok = load_dcp(str(run), CPU, torch.float32)
    from_hf, _ = load_hf(str(tmp_path / "export"), CPU, torch.float32)
    assert tok == "byte"
    for (name, a), b in zip(from_ckpt.state_dict().items(), from_hf.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    args = ["--prompt", "the ", "--max-new-tokens", "12", "--raw"]
    capsys.readouterr()
    assert main(["--checkpoint", str(run / "checkpoints"), *args]) == 0
    a = capsys.readouterr().out
    assert main(["--model.path", str(tmp_path / "export"), *args, "--tokenizer", "byte"]) == 0
    assert capsys.readouterr().out == a and len(a) > 1  # some text, whatever a 3-step model says


def test_cli_on_a_chat_model_answers_as_transformers_does(tmp_path, capsys):
    """`shardfit generate --model.path DIR --prompt TEXT` on a Hugging Face directory with a tokenizer and a chat
    template: the text transformers gives for apply_chat_template + greedy generate + decode, stopping at the same
    EOS ids (the tokenizer's <|im_end|> and generation_config.json's)."""
    path, hf = _save("llama", tmp_path)
    _chat_tokenizer(path)
    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), chat_template=template)
    eos = sorted({hf_tok.convert_tokens_to_ids("<|im_end|>"), hf.generation_config.eos_token_id})
    for prompt in ("how are you?", "hello there"):
        ids = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        new = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos[0])[0, len(ids):].tolist()
        want = hf_tok.decode([t for t in new if t not in eos], skip_special_tokens=True)
        capsys.readouterr()
        assert main(["--model.path", str(path), "--prompt", prompt, "--max-new-tokens", "24", "--device", "cpu"]) == 0
        assert capsys.readouterr().out == want + "\n"


def test_cli_answers_conversations_and_a_system_message_as_transformers_does(tmp_path, capsys):
    """--messages FILE: each record (messages or sharegpt, as fine-tuning reads them) up to its last user turn, so a
    trailing assistant answer of an evaluation set is regenerated; --system goes before --prompt. The text is
    transformers' for the same messages."""
    path, hf = _save("llama", tmp_path)
    _chat_tokenizer(path)
    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), chat_template=template)
    eos = sorted({hf_tok.convert_tokens_to_ids("<|im_end|>"), hf.generation_config.eos_token_id})

    def transformers_says(messages):
        ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        new = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos[0])[0, len(ids):].tolist()
        return hf_tok.decode([t for t in new if t not in eos], skip_special_tokens=True)

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "how are you?"}]
    records = [{"messages": [*chat, {"role": "assistant", "content": "an answer to regenerate"}]},
               {"conversations": [{"from": "human", "value": "how are you today?"}]}]
    file = tmp_path / "eval.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in records))
    want = [transformers_says(chat), transformers_says([{"role": "system", "content": "terse"},
                                                        {"role": "user", "content": "how are you today?"}])]
    common = ["--model.path", str(path), "--max-new-tokens", "16", "--device", "cpu"]
    capsys.readouterr()
    assert main([*common, "--messages", str(file), "--system", "terse"]) == 0  # the first record's own system wins
    assert capsys.readouterr().out == "".join(w + "\n" for w in want)
    assert main([*common, "--prompt", "how are you today?", "--system", "terse"]) == 0
    assert capsys.readouterr().out == want[1] + "\n"
    file.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    from shardfit.errors import ShardfitError

    with pytest.raises(ShardfitError) as e:
        main([*common, "--messages", str(file)])
    assert str(e.value).startswith(f"{file}:1: the conversation has no user turn to answer")


@pytest.mark.parametrize("args, where", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "0.9"], "--top-p"),  # greedy would ignore it: sampling needs --temperature
    (["--top-p", "0.9", "--temperature", "0.7", "--model.path", "x"], "shardfit generate"),  # two sources
])
def test_cli_refuses_bad_flags_before_loading(tmp_path, args, where):
    from shardfit.errors import ShardfitError

    with pytest.raises(ShardfitError) as e:
        main(["--checkpoint", str(tmp_path / "missing"), "--prompt", "hi", *args])
    assert str(e.value).startswith(f"{where}: ")


def test_chat_template_saved_by_transformers_in_its_own_file(tmp_path):
    """transformers 5 saves the template as chat_template.jinja, not in tokenizer_config.json: it is found there."""
    from shardfit.data.tokenizer import build_tokenizer

    (tmp_path / "src").mkdir()
    path, template = _chat_tokenizer(tmp_path / "src")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), chat_template=template,
                                                  eos_token="<|im_end|>")
    hf_tok.save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved"
    config = json.loads((saved / "tokenizer_config.json").read_text())
    if "chat_template" in config:  # an older transformers: make the case this test is about
        (saved / "chat_template.jinja").write_text(config.pop("chat_template"))
        (saved / "tokenizer_config.json").write_text(json.dumps(config))
    ours = prompt_ids(build_tokenizer(str(saved / "tokenizer.json")), str(saved / "tokenizer.json"), "how are you?",
                      raw=False)
    theirs = hf_tok.apply_chat_template([{"role": "user", "content": "how are you?"}], add_generation_prompt=True,
                                        tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)


def test_each_answer_is_one_line_of_output(tmp_path, capsys, monkeypatch):
    """Answers with newlines, carriage returns and backslashes: one line each, in the order asked, that
    unicode_escape (printf '%b') turns back into the answer."""
    import codecs

    import shardfit.cli.generate as gen

    path, _ = _save("llama", tmp_path)
    answers = ["two\nlines", "C:\\new\r\nfolder", "plain"]
    monkeypatch.setattr(gen, "decode", lambda *a, **k: [list(t.encode()) for t in answers])  # the byte tokenizer's
    assert main(["--model.path", str(path), "--raw", "--device", "cpu", "--prompt", "a", "--prompt", "b",
                 "--prompt", "c"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["two\\nlines", "C:\\\\new\\r\\nfolder", "plain"]
    assert [codecs.decode(line, "unicode_escape") for line in lines] == ["two\nlines", "C:\\new\r\nfolder", "plain"]


def test_answers_to_a_closed_pipe_end_quietly(tmp_path):
    """`shardfit generate ... | head -1`: no BrokenPipeError traceback once head has gone; SIGPIPE's status."""
    import os
    import subprocess
    import sys

    path, _ = _save("llama", tmp_path)
    read, write = os.pipe()
    os.close(read)
    p = subprocess.run([sys.executable, "-m", "shardfit", "generate", "--model.path", str(path), "--raw", "--device",
                        "cpu", "--max-new-tokens", "2", "--prompt", "a", "--prompt", "b"], stdout=write,
                       stderr=subprocess.PIPE, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(write)
    assert (p.returncode, p.stderr) == (141, "")


def test_messages_prompts_carry_the_records_tools(tmp_path):
    """--messages on tool-calling records: the prompt holds the record's tools, calls and results, as
    transformers' apply_chat_template(messages, tools=tools, add_generation_prompt=True) renders them."""
    from shardfit.cli.generate import conversations
    from shardfit.data.chat import chat_renderer
    from shardfit.data.tokenizer import build_tokenizer
    from tests.data.chat_templates import tool_tokenizer
    from tests.data.test_chat import CASES, openai_shaped

    path = tool_tokenizer(tmp_path / "qwen")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    case = CASES["a system turn, a call with text, two rounds"]
    file = tmp_path / "eval.jsonl"
    file.write_text(json.dumps(openai_shaped(case)) + "\n")
    [(chat, tools)] = conversations(str(file), None)
    tok = build_tokenizer(str(path))
    ids = prompt_ids(tok, str(path), chat, raw=False, renderer=chat_renderer(str(path)), tools=tools)
    upto = max(i for i, m in enumerate(case["messages"]) if m["role"] == "user") + 1  # up to the last user turn
    assert tok.tok.decode(ids, skip_special_tokens=False) == hf_tok.apply_chat_template(
        case["messages"][:upto], tools=case["tools"], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("length, needle", [
    (64, "--prompt: the prompt has 64 tokens and the model's context is max_seq_len=64: no room for a new token; "
         "fix: shorten the prompt to at most 63 tokens"),
    (80, "--prompt: the prompt has 80 tokens and the model's context is max_seq_len=64"),
    (60, "--max-new-tokens: prompt (60 tokens) + 10 new tokens exceed the model's max_seq_len=64; fix: ask for at "
         "most 4 new tokens"),
])
def test_a_prompt_too_long_for_the_context_names_its_length(length, needle):
    from shardfit.config.schema import ModelConfig
    from shardfit.errors import ShardfitError

    model = build_model(ModelConfig(vocab_size=50, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                    max_seq_len=64))
    with pytest.raises(ShardfitError) as e:
        decode(model, [[1] * length], 10)
    assert needle in str(e.value), str(e.value)


def test_a_negative_seed_names_the_flag(tmp_path):
    from shardfit.errors import ShardfitError

    path, _ = _save("llama", tmp_path)
    with pytest.raises(ShardfitError) as e:
        main(["--model.path", str(path), "--raw", "--device", "cpu", "--prompt", "a", "--seed", "-1",
              "--temperature", "1"])
    assert str(e.value).startswith("--seed: seed=-1 is not a non-negative 64-bit integer")
