"""Fine-tuning data: JSON lines of {"prompt", "completion"} or chat {"messages": [{"role", "content"}, ...]}.

Loss is taken only on what the model should produce: the completion, or every assistant message. A chat is
rendered with the tokenizer's chat template (tokenizer_config.json "chat_template", Jinja, rendered in a sandbox)
when there is one, else with the plain template below. Each example is one sequence: truncated to data.seq_len
(counted and reported) or padded, with labels -100 on prompts and padding. An example with no loss-bearing token
within data.seq_len is left out (counted; a data set of only such examples is refused).

Plain template (documented, stable):   <|role|>\\ncontent\\n   per message, then EOS after each assistant message;
prompt/completion is   prompt + completion + EOS   with loss on completion + EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardfit.data.dataset import ShuffledDataset
from shardfit.data.sources import open_data, parse_json_line
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
    settings, source = {}, str(cfg)
    if cfg.is_file():
        try:
            settings = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ShardfitError(f"unreadable ({getattr(e, 'msg', None) or e})", where=str(cfg),
                                fix="give a valid tokenizer_config.json (JSON, UTF-8)") from None
        if not isinstance(settings, dict):
            raise ShardfitError("is not a JSON object", where=str(cfg), fix="give a valid tokenizer_config.json")
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    jinja = folder / "chat_template.jinja"
    if not template and jinja.is_file():
        # transformers >= 4.43 saves the template in a file of its own, and 5.x only there
        try:
            template, source = jinja.read_text(encoding="utf-8"), str(jinja)
        except (OSError, ValueError) as e:
            raise ShardfitError(f"unreadable ({e})", where=str(jinja), fix="give a UTF-8 Jinja file") from None
    special = {}
    for key in ("bos_token", "eos_token"):  # templates often write {{ bos_token }}
        value = settings.get(key)
        special[key] = value.get("content", "") if isinstance(value, dict) else value or ""
    return ChatRenderer(template if isinstance(template, str) else None, special, source)


class TemplateRaised(Exception):
    """A chat template's own refusal: HF templates call raise_exception("...") on conversations they reject."""


def _raise_exception(message: str):
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


class ChatRenderer:
    """A chat template compiled in a sandbox, with the globals HF's templates call (raise_exception, strftime_now).
    source names the template's file in error lines."""

    def __init__(self, template: str | None, special: dict[str, str] | None = None,
                 source: str = "chat template"):
        self.template, self.special, self.source = None, special or {}, source
        if template:
            from jinja2 import TemplateSyntaxError
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # a template must not run code either

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
            try:
                self.template = env.from_string(template)
            except TemplateSyntaxError as e:
                raise ShardfitError(f"the chat template has a Jinja syntax error ({e.message}, template line "
                                    f"{e.lineno})", where=f"{source} chat_template",
                                    fix="fix the template, or remove it to use the plain template") from None

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str | None = None) -> str:
        """The chat as text; where (the example's file:line) is named when the template refuses it."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except TemplateRaised as e:
            raise ShardfitError(f"the chat template refuses this conversation: {e}", where=where or self.source,
                                fix="fix the example to follow the template's rules (" + self.source + ")") from None
        except Exception as e:  # the template is user code: its own errors (undefined names, bad types) are input
            first = (str(e).splitlines() or [""])[0]
            raise ShardfitError(f"the chat template failed ({type(e).__name__}: {first})",
                                where=where or self.source, fix=f"fix the template in {self.source}") from None

    def segments(self, messages: list[dict], where: str | None = None) -> list[tuple[str, bool]]:
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
            full = self.render(messages[:i + 1], add_generation_prompt=False, where=where)
            if msg["role"] == "assistant":
                prefix = self.render(messages[:i], add_generation_prompt=True, where=where)
                if not full.startswith(prefix) or not prefix.startswith(done):
                    raise ShardfitError("the chat template does not render conversations incrementally",
                                        where=f"{self.source} chat_template",
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


@dataclass
class Examples:
    """What read_examples found: the examples that train, and how many were cut or left out."""

    examples: list[tuple[np.ndarray, np.ndarray]]  # (token ids, trained mask) each
    truncated: int  # kept, but longer than seq_len + 1 tokens: cut to seq_len
    dropped: int  # no loss-bearing token within the first seq_len + 1: left out (they would train nothing)
    pad: int  # the input id of padding


def read_examples(files: list[Path], data_cfg, tokenizer, spec: str | None = None) -> Examples:
    """Every example of the files with at least one loss-bearing token within data.seq_len. An example without one
    (a prompt longer than seq_len, or a template that masks every token) is left out and counted; a data set that
    keeps none is refused here, not trained for zero steps. spec: the data set as error lines name it."""
    renderer = chat_renderer(data_cfg.tokenizer)
    eos_id = tokenizer.eos_id
    examples, truncated, dropped, seq_len = [], 0, 0, data_cfg.seq_len
    for path in files:
        with open_data(path) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                obj = parse_json_line(raw, where)
                if not isinstance(obj, dict):
                    raise ShardfitError("line is not a JSON object", where=where, fix="one JSON object per line")
                ex = _example(obj, where)
                chat = isinstance(ex[0], dict)
                pieces = renderer.segments(ex, where) if chat else ex
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
                if not any(mask[1:seq_len + 1]):  # label t is token t + 1: these are the labels a row keeps
                    dropped += 1
                    continue
                truncated += len(ids) - 1 > seq_len
                examples.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
    if not examples and dropped:
        raise ShardfitError(f"none of the {dropped:,} examples has a loss-bearing token within data.seq_len="
                            f"{seq_len} (prompts longer than that, or every completion token masked)",
                            where=spec or str(files[0]),
                            fix="raise data.seq_len, shorten the prompts, or check the chat template's masks")
    pad = tokenizer.pad_id if getattr(tokenizer, "pad_id", None) is not None else (eos_id or 0)
    return Examples(examples, truncated, dropped, pad)


def dropped_notice(dropped: int, kept: int, seq_len: int, where: str) -> str | None:
    """The start-up line about examples left out by read_examples, or None."""
    if not dropped:
        return None
    return (f"{where}: {dropped:,} of {dropped + kept:,} examples left out: no loss-bearing token within "
            f"data.seq_len={seq_len} (raise data.seq_len to keep them)")
