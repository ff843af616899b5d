"""`shardfit generate`: a look at what a model learned, from a Hugging Face directory or a shardfit checkpoint.

One process, no sharding: the model is built whole on one device (CPU or one GPU), so this is for looking at the
models one GPU holds, not for serving. Every prompt is submitted at once to the Sampler (sampling/runner.py:
continuous batching over a paged KV cache, the prompt prefilled once, then one token per step for every row);
greedy (the default) or temperature + top-p sampling, each prompt's draws seeded by --seed alone (the same answer
whatever other prompts are asked with it). --no-cache decodes each prompt alone through the reference loop
(sampling/reference.py: the whole sequence every step; greedy tokens are the Sampler's). A prompt is sent as a user
message with the assistant's turn opened, in the chat template the model was fine-tuned with (one stderr line names
it): a checkpoint's config.toml records it (data.chat_template), a model directory holds it as its tokenizer's
template (an export writes shardfit's plain one there); a model trained on no chat gets the text as it is, as --raw
sends it. Decoding stops at the tokenizer's EOS or any EOS id in generation_config.json (weights/tokenizer_files.py
eos_ids). Each answer is one line of stdout, in the order asked (one_line: an answer's newlines written as \\n, its
backslashes as \\\\).
Loading is weights/local.py's (a model directory, a checkpoint, a LoRA run's adapters on their base). LoRA:
--adapter puts a PEFT adapter directory on the Hugging Face model (its base: --model.path, or the adapter's
base_model_name_or_path when that is a local directory), unmerged.
"""


from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardfit.errors import ShardfitError

if TYPE_CHECKING:  # torch is imported where it is used: cli/main.py imports every command, and `shardfit train
    # --nproc` must import torch itself, quietly (cli/launch.py import_torch_quietly)
    from shardfit.models.decoder import CausalLM

# The errors of sampling_params the Sampler names, as this command's flags.
FLAGS = {"prompt": "--prompt", "sampling_params.max_tokens": "--max-new-tokens", "sampling_params.seed": "--seed",
         "sampling_params.temperature": "--temperature", "sampling_params.top_p": "--top-p"}


def decode(model: CausalLM, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
           top_p: float = 1.0, eos_ids: set[int] = frozenset(), seed: int = 0, use_cache: bool = True
           ) -> list[list[int]]:
    """The new tokens after each prompt (an EOS id drawn ends them, included), in the order given: all submitted
    at once to one Sampler sized for them, or with use_cache=False each through the reference loop."""
    import torch

    from shardfit.sampling import Sampler, SampleRequest, SamplingParams

    params = SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            stop_tokens=tuple(sorted(eos_ids)))
    reqs = [SampleRequest(p, params) for p in prompts]
    block = 16  # a KV cache that holds every prompt and its answer at once, not a share of the GPU's memory
    need = sum(-(-(len(p) + max_new_tokens) // block) for p in prompts)
    # eager decode steps: a look at a few answers does not pay for capturing a graph per batch size
    sampler = Sampler(model, kv_blocks=max(1, need), block_size=block, max_rows=min(256, max(1, len(prompts))),
                      cuda_graphs=False)
    for r in reqs:  # every prompt checked before any is decoded, the errors naming this command's flags
        try:
            sampler.check(r)
        except ShardfitError as e:
            raise ShardfitError(e.what, where=FLAGS.get(e.where, e.where), fix=e.fix) from None
    with torch.no_grad():
        if not use_cache:
            from shardfit.sampling.reference import reference_decode

            return [reference_decode(model, p, max_new_tokens, temperature=temperature, top_p=top_p,
                                     eos_ids=eos_ids, seed=seed, use_cache=False) for p in prompts]
        return [r.samples[0].tokens for r in sampler.run(reqs)]


def one_line(answer: str) -> str:
    """An answer as one line of output: backslash, newline and carriage return escaped as Python and C write them
    (\\\\, \\n, \\r), so that the k-th line is the k-th answer and `printf '%b\\n'` (or unicode_escape on ASCII)
    gives the text back."""
    return answer.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def prompt_ids(tokenizer, tokenizer_spec: str, text: str | list[dict], raw: bool, renderer=None,
               tools: list[dict] | None = None) -> list[int]:
    """The prompt's tokens: through `renderer` (else the tokenizer's chat template, when it has one) as one user
    message, or the conversation `text` is (with its record's tools), with the assistant's turn opened; as they
    are with raw."""
    from shardfit.data.chat import chat_renderer

    if renderer is None and not raw:
        renderer = chat_renderer(tokenizer_spec)
        renderer = renderer if renderer.template is not None else None
    if raw or renderer is None:
        return tokenizer.encode(text)  # a string: main refuses conversations without a template
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    # the same renderer, special tokens included, as fine-tuning's (data/chat.py)
    return tokenizer.encode(renderer.render(messages, add_generation_prompt=True, tools=tools))


def conversations(path: str, system: str | None) -> list[tuple[list[dict], list[dict] | None]]:
    """The prompts of --messages: each record of a chat file (messages, sharegpt or alpaca, as fine-tuning reads
    them) up to its last user turn, so that the answer is generated where the record may hold one (an evaluation
    set), with the record's tools. One line naming file:line for a record that is no conversation or has no user
    turn."""
    from shardfit.data.formats import CHAT, chat_messages, detect
    from shardfit.data.messages import record_tools
    from shardfit.data.sources import read_records

    if not Path(path).is_file():
        raise ShardfitError("no such file", where=f"--messages {path}", fix="give a JSON lines, JSON or Parquet file")
    out = []
    for obj, where in read_records(Path(path)):
        fmt = detect(obj)
        if fmt not in CHAT:
            raise ShardfitError(f"a record of {fmt}, not a conversation", where=where, fix="give each record as "
                                "{\"messages\": [{\"role\": \"user\", \"content\": ...}, ...]} (or sharegpt, alpaca)")
        msgs = [{k: v for k, v in m.items() if k != "weight"} for m in chat_messages(obj, fmt, where)]
        last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if last is None:
            raise ShardfitError("the conversation has no user turn to answer", where=where,
                                fix="end each conversation with the user's message")
        msgs = msgs[:last + 1]
        out.append((msgs if system is None or msgs[0]["role"] == "system" else
                    [{"role": "system", "content": system}, *msgs], record_tools(obj, where)))
    if not out:
        raise ShardfitError("no conversation in the file", where=f"--messages {path}", fix="give one per line")
    return out


def training_template(tok_spec: str, model_dir: str | None, saved: dict):
    """(renderer, the line that says so) for the template the model was fine-tuned with: a checkpoint's run records
    it in config.toml (data.chat_template: tokenizer, plain or none; auto in runs of older shardfits: the tokenizer's
    when it has one); a model directory holds it as its tokenizer's template (an export writes shardfit's plain one
    there). (None, None): prompts go as they are."""
    from shardfit.config.schema import CHAT_TEMPLATES
    from shardfit.data.chat import ChatRenderer, FileTemplate, chat_renderer

    choice = saved.get("chat_template", "auto")
    if choice == "none":
        return None, None
    if choice == "plain":
        renderer = ChatRenderer(None)
    elif choice not in CHAT_TEMPLATES:  # a Jinja file the run recorded by its path
        renderer = FileTemplate(choice, chat_renderer(tok_spec, Path(model_dir) if model_dir else None).special)
    else:
        renderer = chat_renderer(tok_spec, Path(model_dir) if model_dir else None)
        if renderer.template is None:
            return None, None
    why = (f"data.chat_template={choice} in {saved['where']}" if saved.get("where") else
           f"the model directory {model_dir}")
    return renderer, (f"shardfit: each prompt is a user message in the chat template the model was fine-tuned with, "
                      f"{renderer.describe()} ({why}); --raw sends it as it is")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other input error
        raise ShardfitError(message, where="shardfit generate", fix="see shardfit generate --help")


def generate(argv: list[str]) -> int:
    p = _Parser(prog="shardfit generate", description="Generate text from a Hugging Face model directory "
                "(--model.path, e.g. a --checkpoint.export_hf output) or a shardfit checkpoint (--checkpoint), on "
                "one device. Greedy by default; --temperature > 0 samples, within --top-p. Each answer is one line "
                "of output: its newlines written as \\n, its backslashes as \\\\.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model.path", dest="model_path", help="Hugging Face model directory")
    src.add_argument("--checkpoint", help="a step_XXXXXXXX directory, or a checkpoints/run directory (newest)")
    p.add_argument("--adapter", help="a PEFT LoRA adapter directory to put on the --model.path model (default base: "
                   "the adapter's base_model_name_or_path, when a local directory)")
    asks = p.add_mutually_exclusive_group(required=True)
    asks.add_argument("--prompt", action="append", help="the user's message, in the chat template the model was "
                      "fine-tuned with; text to continue for a model trained on no chat (repeatable: one answer "
                      "each)")
    asks.add_argument("--messages", metavar="FILE", help="conversations (JSON lines, JSON or Parquet; messages, "
                      "sharegpt or alpaca records, as fine-tuning reads them): one answer each, after its last user "
                      "turn")
    p.add_argument("--system", help="a system message before each prompt (a conversation's own system turn wins)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many tokens (default 128); "
                   "decoding stops earlier at an EOS token")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within the most likely tokens of this total "
                   "probability (needs --temperature > 0; default 1: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--tokenizer", help="tokenizer.json or 'byte' (default: the model's or the run's)")
    p.add_argument("--raw", action="store_true", help="send the prompt as it is, with no chat template")
    p.add_argument("--no-cache", action="store_true", help="decode each prompt alone, recomputing the whole sequence "
                   "every step (the reference)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    a = p.parse_args(argv)
    if a.adapter and a.checkpoint:
        raise ShardfitError("--adapter goes on a Hugging Face model, not a checkpoint", where="--adapter",
                            fix="give --model.path (a LoRA run's checkpoint carries its adapters already)")
    if a.adapter and not a.model_path:
        from shardfit.weights.peft import adapter_base

        a.model_path = adapter_base(a.adapter)
        if a.model_path is None:
            raise ShardfitError("the adapter's base_model_name_or_path is not a local directory", where="--adapter",
                                fix="give the base model with --model.path")
    if not (a.model_path or a.checkpoint):
        p.error("one of the arguments --model.path --checkpoint is required")
    for name, ok, fix in (("--max-new-tokens", a.max_new_tokens >= 1, "give 1 or more"),
                          ("--temperature", a.temperature >= 0, "give 0 (greedy) or more"),
                          ("--top-p", 0 < a.top_p <= 1, "give a value in (0, 1]")):
        if not ok:
            raise ShardfitError(f"{getattr(a, name[2:].replace('-', '_'))} is out of range", where=name, fix=fix)
    if a.messages and a.raw:
        raise ShardfitError("conversations need the chat template, but --raw sends text as it is", where="--messages",
                            fix="drop --raw, or give plain --prompt text")
    if a.system is not None and a.raw:
        raise ShardfitError("--system needs the chat template, but --raw sends text as it is", where="--system",
                            fix="drop --raw, or put the system text into the prompt")
    prompts = conversations(a.messages, a.system) if a.messages else [
        (t if a.system is None else [{"role": "system", "content": a.system}, {"role": "user", "content": t}], None)
        for t in a.prompt]  # (text or messages, the record's tools)
    if a.top_p < 1 and a.temperature == 0:  # greedy decoding would ignore it
        raise ShardfitError(f"{a.top_p} needs sampling, but --temperature is 0 (greedy)", where="--top-p",
                            fix="add --temperature (e.g. 0.7) to sample, or drop --top-p")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise ShardfitError("no CUDA device is available", where="--device", fix="use --device cpu (or auto)")
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    dtype = getattr(torch, a.dtype) if a.dtype != "auto" else (torch.bfloat16 if device.type == "cuda"
                                                              else torch.float32)
    from shardfit.weights.local import load_dcp, load_hf
    from shardfit.weights.tokenizer_files import eos_ids

    saved: dict = {}  # a checkpoint's record of its chat template
    if a.model_path:
        model, tok_spec = load_hf(a.model_path, device, dtype, adapter=a.adapter)
    else:
        model, tok_spec = load_dcp(a.checkpoint, device, dtype, saved)
    tok_spec = a.tokenizer or tok_spec
    from shardfit.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tok_spec)
    if tokenizer.vocab_size > model.cfg.vocab_size:  # its ids would index past the embedding
        raise ShardfitError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model.cfg.vocab_size}",
                            where=a.tokenizer or tok_spec, fix="use the tokenizer the model was trained with "
                            "(--tokenizer), or a model whose vocab_size covers it")
    # generation_config.json sits beside config.json, and beside the tokenizer.json a checkpoint's run used
    where = Path(a.model_path) if a.model_path else Path(tok_spec).parent if tok_spec != "byte" else None
    stops = eos_ids(tokenizer, where)
    renderer, line = (None, None) if a.raw else training_template(tok_spec, a.model_path, saved)
    if line:
        print(line, file=sys.stderr, flush=True)
    if renderer is None and not all(isinstance(t, str) for t, _ in prompts):
        raise ShardfitError("conversations and --system need a chat template, and this model was fine-tuned with "
                            "none", where="--messages" if a.messages else "--system",
                            fix="give plain --prompt text, or --tokenizer with a chat template")
    ids = [prompt_ids(tokenizer, tok_spec, text, raw=renderer is None, renderer=renderer, tools=tools)
           for text, tools in prompts]
    for out in decode(model, ids, a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, eos_ids=stops,
                      seed=a.seed, use_cache=not a.no_cache):
        print(one_line(tokenizer.decode([t for t in out if t not in stops])), flush=True)
    return 0
