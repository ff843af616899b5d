"""Fine-tuning data: JSON lines of {"prompt", "completion"} or chat {"messages": [{"role", "content"}, ...]}.

Loss is taken only on what the model should produce: the completion, or every assistant message. A chat is
rendered with the tokenizer's chat template (tokenizer_config.json "chat_template", Jinja, rendered in a sandbox)
when there is one, else with the plain template below. Each example is one sequence: truncated to data.seq_len
(counted and reported) or padded, with labels -100 on prompts and padding.

Plain template (documented, stable):   <|role|>\\ncontent\\n   per message, then EOS after each assistant message;
prompt/completion is   prompt + completion + EOS   with loss on completion + EOS.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shardfit.data.packing import ShuffledDataset
from shardfit.errors import ShardfitError

IGNORE = -100


def chat_renderer(tokenizer_spec: str) -> ChatRenderer:
    """The tokenizer's chat template (tokenizer_config.json's "chat_template", else chat_template.jinja, beside
    tokenizer.json) with its special tokens, or the plain template when it has none: fine-tuning and `shardfit
    generate` render chats through this one object."""
    if tokenizer_spec == "byte":
        return ChatRenderer(None)
    path = Path(tokenizer_spec)
    folder = path if path.is_dir() else path.parent
    cfg = folder / "tokenizer_config.json"
    settings = {}
    if cfg.is_file():
        try:
            settings = json.loads(cfg.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ShardfitError(f"invalid JSON ({e.msg})", where=str(cfg)) from None
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = folder / "chat_template.jinja"
    if not template and jinja.is_file():
        # transformers >= 4.43 saves the template in a file of its own, and 5.x only there
        template = jinja.read_text(encoding="utf-8")
    special = {}
    for key in ("bos_token", "eos_token"):  # templates often write {{ bos_token }}
        value = settings.get(key)
        special[key] = value.get("content", "") if isinstance(value, dict) else value or ""
    return ChatRenderer(template if isinstance(template, str) else None, special)


class ChatRenderer:
    def __init__(self, template: str | None, special: dict[str, str] | None = None):
        self.template, self.special = None, special or {}
        if template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # a template must not run code either

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self.template = env.from_string(template)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """(text, trained) pieces whose concatenation is the rendered chat; trained marks assistant output."""
        out: list[tuple[str, bool]] = []
        done = ""
        for i, msg in enumerate(messages):
            if self.template is None:
                head = f"<|{msg['role']}|>\n"
                if msg["role"] == "assistant":
                    out += [(head, False), (msg["content"] + "\n", True)]
                else:
                    out.append((head + msg["content"] + "\n", False))
                continue
            full = self.render(messages[:i + 1], add_generation_prompt=False)
            if msg["role"] == "assistant":
                prefix = self.render(messages[:i], add_generation_prompt=True)
                if not full.startswith(prefix) or not prefix.startswith(done):
                    raise ShardfitError("the chat template does not render conversations incrementally",
                                        where="tokenizer_config.json chat_template",
                                        fix="use prompt/completion data or a template without look-ahead")
                out += [(prefix[len(done):], False), (full[len(prefix):], True)]
            else:
                out.append((full[len(done):], False))
            done = full
        return out


def _example(obj: dict, where: str) -> list[tuple[str, bool]] | list[dict]:
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise ShardfitError("'messages' must be a list of {role, content} strings", where=where)
        if not any(m["role"] == "assistant" for m in msgs):
            raise ShardfitError("conversation has no assistant message to learn from", where=where)
        return msgs
    if isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
        return [(obj["prompt"], False), (obj["completion"], True)]
    keys = ", ".join(sorted(obj))
    raise ShardfitError(f"expected 'prompt' and 'completion' strings or 'messages' (found: {keys})", where=where,
                        fix="one fine-tuning example per line")


def is_sft_file(path: Path) -> bool:
    """A JSON-lines file whose first object is a fine-tuning example."""
    if path.suffix.lower() not in (".jsonl", ".json"):
        return False
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return False
                return isinstance(obj, dict) and ("messages" in obj or {"prompt", "completion"} <= set(obj))
    return False


class ExampleDataset(ShuffledDataset):
    """One example per item: a padded row of seq_len (data.pack=false), or unpadded for token-budget micro-batches.
    An example longer than seq_len + 1 tokens is truncated (counted in `truncated`)."""

    def __init__(self, examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, seed: int, pad_id: int,
                 truncated: int, where: str, ordered: bool = False):
        if not examples:
            raise ShardfitError("no fine-tuning examples", where=where, fix="check data.path")
        self.examples, self.seq_len, self.seed, self.pad_id = examples, seq_len, seed, pad_id
        self.num_windows = len(examples)
        self.truncated, self.where, self.ordered = truncated, where, ordered
        self.n_tokens = sum(len(e[0]) for e in examples)  # the start-up line's size (no copy of the examples)

    def item(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return example_tokens(*self.examples[self._item(k)], self.seq_len)

    def item_length(self, k: int) -> int:
        return min(len(self.examples[self._item(k)][0]) - 1, self.seq_len)

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        inputs, labels, _ = self.item(k)
        n = len(inputs)
        return (pad_to(inputs, self.seq_len, self.pad_id), pad_to(labels, self.seq_len, IGNORE), None, n)

    def holdout(self, fraction: float) -> tuple[list, list]:
        """(training, validation) examples: a seeded `fraction` of them held out, each list in file order."""
        n = len(self.examples)
        n_val = max(1, int(round(n * fraction)))
        if n_val >= n:
            raise ShardfitError(f"data.val_fraction={fraction} leaves no training example of {n}",
                                where="data.val_fraction", fix="use a smaller fraction")
        val = set(np.random.default_rng([self.seed, 7919]).permutation(n)[:n_val].tolist())
        return ([e for i, e in enumerate(self.examples) if i not in val],
                [e for i, e in enumerate(self.examples) if i in val])


def example_tokens(ids: np.ndarray, trained: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An example as (inputs [L], labels [L], positions [L]), L = min(len - 1, limit): label t is token t + 1 where
    that token is trained, else -100."""
    n = min(len(ids) - 1, limit)
    labels = np.where(trained[1:n + 1], ids[1:n + 1], IGNORE)
    return ids[:n], labels, np.arange(n)


def pad_to(x: np.ndarray, length: int, value: int) -> np.ndarray:
    out = np.full(length, value, dtype=np.int64)
    out[:len(x)] = x
    return out


def read_examples(files: list[Path], data_cfg, tokenizer) -> tuple[list[tuple[np.ndarray, np.ndarray]], int, int]:
    """Every example of the files as (token ids, trained mask); the number longer than seq_len + 1; the pad id."""
    renderer = chat_renderer(data_cfg.tokenizer)
    eos_id = tokenizer.eos_id
    examples, truncated = [], 0
    for path in files:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise ShardfitError(f"invalid JSON line ({e})", where=where,
                                        fix="one JSON object per line") from None
                if not isinstance(obj, dict):
                    raise ShardfitError("line is not a JSON object", where=where)
                ex = _example(obj, where)
                chat = isinstance(ex[0], dict)
                pieces = renderer.segments(ex) if chat else ex
                # A chat template writes its own end-of-turn tokens; otherwise EOS follows each trained piece.
                add_eos = eos_id is not None and not (chat and renderer.template is not None)
                ids, mask = [], []
                for text, trained in pieces:
                    toks = tokenizer.encode(text) if text else []
                    ids += toks
                    mask += [trained] * len(toks)
                    if trained and add_eos:
                        ids.append(eos_id)
                        mask.append(True)
                truncated += len(ids) - 1 > data_cfg.seq_len
                examples.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
    pad = tokenizer.pad_id if getattr(tokenizer, "pad_id", None) is not None else (eos_id or 0)
    return examples, truncated, pad
