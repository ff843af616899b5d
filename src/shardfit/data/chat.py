"""Chat templates: how a conversation becomes text, for fine-tuning (data/sft.py) and `shardfit generate`.

data.chat_template picks one: tokenizer (tokenizer_config.json's "chat_template", else chat_template.jinja beside
tokenizer.json: Jinja rendered in a sandbox, with the tokenizer's special tokens), plain (shardfit's template below),
auto (the tokenizer's when it has one, else plain), or the path of a Jinja file (FileTemplate: rendered with the
tokenizer's special tokens). The run's config.toml records the one applied (none when the data held no chat; a file
by its path), and an export holds it as the tokenizer's template (PLAIN_JINJA for plain, a file's text for a file),
so `shardfit generate` renders a prompt as the model was fine-tuned to see it.

Plain template (documented, stable):   <|role|>\\ncontent\\n   per message, EOS after each assistant message (an
id, not text: PLAIN_JINJA writes the tokenizer's eos_token there); <|assistant|>\\n opens the assistant's turn.
Loss is taken on each assistant message (content, newline, EOS), unless the message says "weight": 0. The plain
template has no place for tools: a record with tools or tool calls needs the tokenizer's template.

A tokenizer's template renders what transformers' apply_chat_template(messages, tools=tools) renders (the same
Jinja environment, tested against it): the record's tools reach it as `tools`; a template that never reads tools
(or tool_calls) while a record has them is refused rather than trained without them. Its loss is on the text each
assistant message adds (segments()).
"""

from __future__ import annotations

import json
from pathlib import Path

from shardfit.config.schema import CHAT_TEMPLATES
from shardfit.errors import ShardfitError
from shardfit.fsutil import write_atomic

# The plain template as Jinja, for exports (transformers, vLLM and `shardfit generate` read it): the same text as
# ChatRenderer(None) renders, EOS written as the tokenizer's eos_token.
PLAIN_JINJA = (r"{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}"
               r"{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
               r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def template_for(choice: str, tokenizer_spec: str) -> ChatRenderer | None:
    """The renderer data.chat_template asks for (None for none: chats are refused), its `kind` the one applied."""
    if choice == "none":
        return None
    if choice not in CHAT_TEMPLATES:  # the path of a Jinja file (the config loader checked it is a readable one)
        return FileTemplate(choice, chat_renderer(tokenizer_spec).special)
    renderer = ChatRenderer(None) if choice == "plain" else chat_renderer(tokenizer_spec)
    if choice == "tokenizer" and renderer.template is None:
        raise ShardfitError("the tokenizer has no chat template (no chat_template in tokenizer_config.json, no "
                            "chat_template.jinja)", where=f"data.chat_template={choice}",
                            fix="set data.chat_template=auto or plain to use shardfit's plain template")
    return renderer


def renderer_of(renderer: ChatRenderer | None, data_cfg, where: str, what: str) -> ChatRenderer:
    """The data's chat renderer, made on the first chat record (`what`: an example, a pair) that needs one;
    data.chat_template=none refuses that record in one line."""
    if renderer is not None:
        return renderer
    renderer = template_for(data_cfg.chat_template, data_cfg.tokenizer)
    if renderer is None:
        raise ShardfitError(f"a chat {what}, but data.chat_template=none", where=where,
                            fix="set data.chat_template to auto, tokenizer or plain")
    return renderer


def export_template(out: Path, kind: str) -> None:
    """Write the template a run applied into its Hugging Face export `out`: the tokenizer's is there already (its
    files are copied); plain (or a file's) is written as chat_template.jinja, and into a copied tokenizer_config.json
    whose own template it replaces (that file's template is read first)."""
    if kind == "plain":
        text = PLAIN_JINJA
    elif kind not in CHAT_TEMPLATES:  # a Jinja file's template: exported as the plain one is
        text = FileTemplate.read(kind)
    else:
        return
    write_atomic(out / "chat_template.jinja", text)
    cfg = out / "tokenizer_config.json"
    if cfg.is_file():
        try:
            settings = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # copied as it was; chat_renderer names it when it is read
        if isinstance(settings, dict) and settings.get("chat_template"):
            write_atomic(cfg, json.dumps({**settings, "chat_template": text}, indent=2))


def chat_renderer(tokenizer_spec: str, folder: Path | None = None) -> ChatRenderer:
    """The tokenizer's chat template (tokenizer_config.json's "chat_template", else chat_template.jinja, beside
    tokenizer.json, or in `folder`: a model directory) with its special tokens, or the plain template when it has
    none: fine-tuning and `shardfit generate` render chats through this one object."""
    if tokenizer_spec == "byte" and folder is None:
        return ChatRenderer(None)
    path = Path(tokenizer_spec)
    folder = folder if folder is not None else path if path.is_dir() else path.parent
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


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson filter, which chat templates are written against (tool schemas, call arguments):
    json.dumps in the key order given, no HTML escaping. Jinja's own sorts the keys and escapes <, >, &, ': a
    template would render other text than transformers does."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag():
    """The {% generation %} ... {% endgeneration %} tag of transformers' templates (it marks the assistant's text
    for return_assistant_tokens_mask): rendered as its body, in a call block as transformers renders it (the same
    scoping). segments() finds the trained text by rendering prefixes instead."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


def _calls_of(i: int) -> str:
    return f"the tool_calls of message {i} (from 0, of the conversation as rendered)"


class TemplateRaised(Exception):
    """A chat template's own refusal: HF templates call raise_exception("...") on conversations they reject."""


def _raise_exception(message: str):
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


class ChatRenderer:
    """A chat template compiled in a sandbox as transformers' apply_chat_template compiles it: its tojson filter,
    the loop controls and {% generation %} tags, the globals HF's templates call (raise_exception, strftime_now).
    source names the template's file in error lines."""

    def __init__(self, template: str | None, special: dict[str, str] | None = None,
                 source: str = "chat template"):
        self.template, self.special, self.source, self.text = None, special or {}, source, template
        self.reads: set[str] = set()  # the variables the template reads (tools, messages, ...)
        if template:
            from jinja2 import TemplateSyntaxError, meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # a template must not run code either

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_generation_tag(), "jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
            try:
                self.template = env.from_string(template)
                self.reads = meta.find_undeclared_variables(env.parse(template))
            except TemplateSyntaxError as e:
                raise ShardfitError(f"the chat template has a Jinja syntax error ({e.message}, template line "
                                    f"{e.lineno})", where=f"{source} chat_template",
                                    fix="fix the template, or remove it to use the plain template") from None

    @property
    def kind(self) -> str:
        """What data.chat_template records: the tokenizer's template, or shardfit's plain one."""
        return "plain" if self.template is None or self.text == PLAIN_JINJA else "tokenizer"

    def describe(self) -> str:
        """The template as the training header and `shardfit generate` name it."""
        if self.template is None:
            return "shardfit's plain template (<|role|>\\n...)"
        whose = "shardfit's plain" if self.kind == "plain" else "the tokenizer's"
        return f"{whose} template from {self.source}"

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str | None = None,
               tools: list[dict] | None = None) -> str:
        """The chat as text, as apply_chat_template(messages, tools=tools, add_generation_prompt=...) renders it;
        where (the example's file:line) is named when the template refuses it. The plain template's EOS is an id,
        not text: it is left out here (segments() places it)."""
        self._check_tools(messages, tools, where)
        if self.template is None:
            return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + (
                "<|assistant|>\n" if add_generation_prompt else "")
        try:
            return self.template.render(messages=messages, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special)
        except TemplateRaised as e:
            raise ShardfitError(f"the chat template refuses this conversation: {e}", where=where or self.source,
                                fix="fix the example to follow the template's rules (" + self.source + ")") from None
        except Exception as e:  # the template is user code: its own errors (undefined names, bad types) are input
            first = (str(e).splitlines() or [""])[0]
            raise ShardfitError(f"the chat template failed ({type(e).__name__}: {first})",
                                where=where or self.source, fix=f"fix the template in {self.source}") from None

    def _check_tools(self, messages: list[dict], tools: list[dict] | None, where: str | None) -> None:
        """Tool schemas and calls reach a template that writes them, or the conversation is refused: a model
        trained on calls to tools whose schemas its prompts never showed learns the wrong thing, silently."""
        calls = next((i for i, m in enumerate(messages) if m.get("tool_calls")), None)
        if not tools and calls is None:
            return
        if self.template is None:
            what = "tools" if tools else _calls_of(calls)
            raise ShardfitError(f"{what}: shardfit's plain template has no place for tool schemas or calls",
                                where=where or self.source, fix="use a tokenizer whose chat template renders tools "
                                "(e.g. Qwen2.5's) with data.chat_template=tokenizer")
        unread = ("tools", "tools") if tools and "tools" not in self.reads else (
            (_calls_of(calls), "tool_calls") if calls is not None and "tool_calls" not in self.text
            else None)
        if unread:
            raise ShardfitError(f"{unread[0]}: the chat template ({self.source}) never reads {unread[1]}: they "
                                "would be dropped", where=where or self.source,
                                fix="use a tool-aware chat template (e.g. Qwen2.5's), or leave the tools out")

    def segments(self, messages: list[dict], where: str | None = None,
                 tools: list[dict] | None = None) -> list[tuple[str | None, bool]]:
        """(text, trained) pieces whose concatenation is the rendered chat; trained marks assistant output (not
        an assistant message with "weight": 0). Text None is the plain template's EOS after an assistant message.

        A template's trained text is found by rendering: the assistant message i spans from the end of the chat
        before it with the assistant's turn opened (messages[:i], add_generation_prompt) to the end of the chat
        up to it (messages[:i + 1]), both prefixes of the whole chat's text, or the template does not render
        incrementally (it is refused). Everything else is the whole chat's own text: a template may write a
        message differently once another follows it (Qwen2.5 closes a run of tool results after the last one)."""
        if self.template is None:
            self._check_tools(messages, tools, where)
            out: list[tuple[str | None, bool]] = []
            for msg in messages:
                head = f"<|{msg['role']}|>\n"
                if msg["role"] == "assistant":
                    trained = msg.get("weight", 1) != 0
                    out += [(head, False), (msg["content"] + "\n", trained), (None, trained)]
                else:
                    out.append((head + msg["content"] + "\n", False))
            return out
        text = self.render(messages, add_generation_prompt=False, where=where, tools=tools)
        out, done = [], 0
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant" or msg.get("weight", 1) == 0:
                continue
            opened = self.render(messages[:i], add_generation_prompt=True, where=where, tools=tools)
            closed = self.render(messages[:i + 1], add_generation_prompt=False, where=where, tools=tools)
            if len(opened) < done or not closed.startswith(opened) or not text.startswith(closed):
                raise ShardfitError("the chat template does not render conversations incrementally",
                                    where=f"{self.source} chat_template",
                                    fix="use prompt/completion data or a template without look-ahead")
            out += [(text[done:len(opened)], False), (text[len(opened):len(closed)], True)]
            done = len(closed)
        out.append((text[done:], False))
        return [(piece, trained) for piece, trained in out if piece]


class FileTemplate(ChatRenderer):
    """data.chat_template=PATH: a Jinja chat template of its own file, with the tokenizer's special tokens. Its kind
    is the path: the run's config.toml records it, `shardfit generate` renders through it, an export holds its text."""

    def __init__(self, path: str, special: dict[str, str]):
        super().__init__(self.read(path), special, path)

    @staticmethod
    def read(path: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, ValueError) as e:  # gone since the run recorded it, unreadable, not UTF-8
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
            raise ShardfitError(f"cannot read the chat template ({reason})", where=f"data.chat_template={path}",
                                fix="restore the file, or set data.chat_template to auto, tokenizer or plain") from None

    @property
    def kind(self) -> str:
        return self.source

    def describe(self) -> str:
        return f"the template of {self.source}"
