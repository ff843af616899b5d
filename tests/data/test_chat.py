"""data/chat.py against transformers: with a tool-aware template (Qwen2.5's), a record's tools, calls and results
render exactly as `apply_chat_template(messages, tools=tools, tokenize=False)` renders them, for the record as
transformers documents it and as the OpenAI API writes it; fine-tuning trains on the assistant's text (its calls
included) and nothing else, its tokens those of the whole rendered chat; the template environment is transformers'
(tojson, loop controls, {% generation %}); tools that a template cannot show are refused in one line."""

import copy
import json
import re

import pytest

from shardfit.config import load_config
from shardfit.data.build import build_datasets
from shardfit.data.chat import ChatRenderer
from shardfit.data.formats import to_example
from shardfit.data.messages import record_tools
from shardfit.errors import ShardfitError
from tests.data.chat_templates import QWEN25, tool_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a <city> & its 'feel', in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a city"}},
                   "required": ["city"]}}}  # key order not sorted, characters Jinja's own tojson would escape
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The local time",
                                          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


def _call(name, args, call_id):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


# Conversations as transformers documents them (arguments as objects); each is also tested as the OpenAI API writes
# it (openai_shaped)
CASES = {
    "parallel calls, their results in one turn": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "tool_calls": [_call("get_weather", {"city": "Paris"}, "c1"),
                                             _call("get_weather", {"city": "Lyon"}, "c2")]},
        {"role": "tool", "tool_call_id": "c1", "content": "18"},
        {"role": "tool", "tool_call_id": "c2", "content": "20"},
        {"role": "assistant", "content": "Paris 18 °C, Lyon 20 °C."}]},
    "a system turn, a call with text, two rounds": {"tools": [WEATHER, CLOCK], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("get_weather", {"city": "Oslo"}, "a")]},
        {"role": "tool", "tool_call_id": "a", "content": "-3"},
        {"role": "assistant", "content": "-3 °C."},
        {"role": "user", "content": "And the time there?"},
        {"role": "assistant", "tool_calls": [_call("get_time", {"tz": "Europe/Oslo"}, "b")]},
        {"role": "tool", "tool_call_id": "b", "content": "09:12"},
        {"role": "assistant", "content": "09:12."}]},
    "transformers' own call layout": {"tools": [CLOCK], "messages": [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "tool_calls": [{"name": "get_time", "arguments": {}}]},
        {"role": "tool", "content": "10:00"},
        {"role": "assistant", "content": "10:00."}]},
    "no tools: the template's other branch": {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
}


def openai_shaped(record: dict) -> dict:
    """The record as the OpenAI API writes it: arguments as compact JSON text, content null beside the calls."""
    out = copy.deepcopy(record)
    for m in out["messages"]:
        for call in m.get("tool_calls", []):
            fn = call.get("function", call)
            fn["arguments"] = json.dumps(fn["arguments"], separators=(",", ":"))
        if "tool_calls" in m:
            m.setdefault("content", None)
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(tokenizer.json path, transformers' tokenizer of the same folder)."""
    transformers = pytest.importorskip("transformers")
    path = tool_tokenizer(tmp_path_factory.mktemp("qwen"))
    return path, transformers.AutoTokenizer.from_pretrained(str(path.parent))


@pytest.mark.parametrize("name", CASES)
def test_tools_render_as_transformers_renders_them(qwen, name):
    _, hf = qwen
    case = CASES[name]
    renderer = ChatRenderer(QWEN25)
    for record in (case, openai_shaped(case)):
        msgs = to_example(record, "messages", "data.format", "c.jsonl:1")
        tools = record_tools(record, "c.jsonl:1")
        for n in range(1, len(msgs) + 1):  # every prefix, as segments() renders them, with and without the prompt
            for opened in (False, True):
                want = hf.apply_chat_template(case["messages"][:n], tools=case.get("tools"), tokenize=False,
                                              add_generation_prompt=opened)
                assert renderer.render(msgs[:n], opened, tools=tools) == want, (name, n, opened)


def test_fine_tuning_trains_on_the_assistants_text_with_the_tools_in_the_prompt(tmp_path, qwen):
    path, hf = qwen
    records = [openai_shaped(c) for c in CASES.values()]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(None, [f"--data.path={data}", f"--data.tokenizer={path}", "--model.vocab_size=300",
                             "--data.seq_len=1024", "--data.pack=false"])
    train, _, tok = build_datasets(cfg.data, cfg.model.vocab_size)
    assert train.info["template"] == "tokenizer"
    for (ids, mask), case in zip(train.examples, CASES.values(), strict=True):
        chat, tools = case["messages"], case.get("tools")
        assert tok.tok.decode(ids.tolist(), skip_special_tokens=False) == hf.apply_chat_template(
            chat, tools=tools, tokenize=False)  # the whole chat, tools and tool results included
        # trained: what each assistant message adds to the chat before it, by transformers' rendering
        want = "".join(hf.apply_chat_template(chat[:i + 1], tools=tools, tokenize=False)[len(
            hf.apply_chat_template(chat[:i], tools=tools, tokenize=False, add_generation_prompt=True)):]
            for i, m in enumerate(chat) if m["role"] == "assistant")
        assert tok.tok.decode(ids[mask].tolist(), skip_special_tokens=False) == want
    first = tok.tok.decode(train.examples[0][0][train.examples[0][1]].tolist(), skip_special_tokens=False)
    assert first == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
                     'Paris 18 °C, Lyon 20 °C.<|im_end|>\n')  # calls and answer; no schema, no tool result


def test_the_template_environment_is_transformers(qwen):
    """{% generation %} (a no-op here), {% break %} / {% continue %} and transformers' tojson (key order kept,
    nothing HTML-escaped, non-ASCII as it is) render as apply_chat_template renders them."""
    _, hf = qwen
    template = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "{% if m.role == 'stop' %}{% break %}{% endif %}<{{ m.role }}>"
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
                "{% else %}{{ m.content }}{% endif %}{% endfor %}{{ tools | tojson }}{{ tools | tojson(indent=2) }}")
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}, {"role": "stop", "content": "x"}, {"role": "user", "content": "y"}]
    want = hf.apply_chat_template(chat, tools=[WEATHER], tokenize=False, chat_template=template)
    assert ChatRenderer(template).render(chat, False, tools=[WEATHER]) == want
    assert '"description": "Weather in a <city> & its \'feel\', in °C"' in want


NO_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_CALLS = "{% if tools %}{{ tools | tojson }}{% endif %}" + NO_TOOLS
CALL = {"messages": [{"role": "user", "content": "t?"}, {"role": "assistant", "content": None,
                                                         "tool_calls": [_call("get_time", "{}", "x")]}]}


@pytest.mark.parametrize("template, record, needle", [
    (None, CASES["transformers' own call layout"], r"c.jsonl:1: tools: shardfit's plain template has no place for "
     r"tool schemas or calls; fix: use a tokenizer whose chat template renders tools \(e.g. Qwen2.5's\)"),
    (None, CALL, r"c.jsonl:1: the tool_calls of message 1 \(from 0, of the conversation as rendered\): shardfit's "
     r"plain template has no place"),
    (NO_TOOLS, {**CALL, "tools": [CLOCK]}, r"c.jsonl:1: tools: the chat template \(.*tokenizer_config.json\) never "
     r"reads tools: they would be dropped; fix: use a tool-aware chat template"),
    (NO_CALLS, {**CALL, "tools": [CLOCK]}, r"c.jsonl:1: the tool_calls of message 1 .*: the chat template "
     r"\(.*\) never reads tool_calls: they would be dropped"),
])
def test_tools_a_template_cannot_show_are_refused(tmp_path, template, record, needle):
    tokenizer = "byte"
    if template is not None:  # a tokenizer with this template instead of Qwen's
        tokenizer = tool_tokenizer(tmp_path)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(record) + "\n")
    cfg = load_config(None, [f"--data.path={data}", "--data.seq_len=128", "--data.pack=false",
                             f"--data.tokenizer={tokenizer}", "--model.vocab_size=300"])
    with pytest.raises(ShardfitError) as e:
        build_datasets(cfg.data, cfg.model.vocab_size)
    assert re.search(needle, str(e.value)) and "\n" not in str(e.value), str(e.value)
