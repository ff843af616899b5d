"""data/messages.py: chat records as users have them. OpenAI's shapes (content null beside tool_calls, arguments as
JSON text, content as a list of parts, null keys, the tool role's tool_call_id) and ShareGPT's function_call and
observation speakers tokenize as the same conversation written plainly; anything else is one line naming the
record's file:line, the message's index and the field."""

import json
import re

import pytest

from shardfit.config import load_config
from shardfit.data.build import build_datasets
from shardfit.errors import ShardfitError
from tests.data.chat_templates import tool_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "content": "18"}, {"role": "assistant", "content": "18 °C."}]


def _examples(tmp_path, name, records, tokenizer="byte"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(None, [f"--data.path={path}", "--data.seq_len=1024", "--data.pack=false",
                             f"--data.tokenizer={tokenizer}", "--model.vocab_size=300"])
    train, _, _ = build_datasets(cfg.data, cfg.model.vocab_size)
    return [(ids.tolist(), mask.tolist()) for ids, mask in train.examples]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tool_tokenizer(tmp_path_factory.mktemp("qwen"))


def test_sharegpt_function_call_and_observation_are_a_call_and_its_result(tmp_path, qwen):
    """LLaMA-Factory's ShareGPT: the call as JSON text from function_call, the result from observation, the tools
    as JSON text; a list of calls is parallel calls."""
    turns = [{"from": "human", "value": "Weather in Paris?"},
             {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
             {"from": "observation", "value": "18"}, {"from": "gpt", "value": "18 °C."}]
    got = _examples(tmp_path, "s.jsonl", [{"conversations": turns, "tools": json.dumps([WEATHER])}], qwen)
    assert got == _examples(tmp_path, "m.jsonl", [{"messages": CALLED, "tools": [WEATHER]}], qwen)
    both = {"name": "get_weather", "arguments": {"city": "Lyon"}}
    parallel = [turns[0], {**turns[1], "value": json.dumps([json.loads(turns[1]["value"]), both])}, *turns[2:]]
    calls = [*CALLED[1]["tool_calls"], {"type": "function", "function": both}]
    assert _examples(tmp_path, "p.jsonl", [{"conversations": parallel, "tools": [WEATHER]}], qwen) == _examples(
        tmp_path, "q.jsonl", [{"messages": [CALLED[0], {**CALLED[1], "tool_calls": calls}, *CALLED[2:]],
                               "tools": [WEATHER]}], qwen)


def test_openai_shapes_tokenize_as_the_plain_conversation(tmp_path, qwen):
    """content null and the arguments as JSON text (the API's response), ids on calls and results, null keys the
    API writes on every message (refusal, function_call, audio)."""
    api = [{**CALLED[0], "name": None},
           {"role": "assistant", "content": None, "refusal": None, "function_call": None, "audio": None,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18"},
           {**CALLED[3], "tool_calls": None, "refusal": None}]
    with_ids = [CALLED[0], {**CALLED[1], "tool_calls": [{"id": "call_1", **CALLED[1]["tool_calls"][0]}]},
                {**CALLED[2], "tool_call_id": "call_1"}, CALLED[3]]
    got = _examples(tmp_path, "api.jsonl", [{"messages": api, "tools": [WEATHER]}], qwen)
    assert got == _examples(tmp_path, "m.jsonl", [{"messages": with_ids, "tools": [WEATHER]}], qwen)
    assert got == _examples(tmp_path, "n.jsonl", [{"messages": CALLED, "tools": [WEATHER]}], qwen)  # Qwen: no ids


def test_content_parts_are_their_texts_joined_by_newlines(tmp_path):
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    plain = [{"role": "user", "content": "first\nsecond"}, {"role": "assistant", "content": "ok"}]
    assert _examples(tmp_path, "parts.jsonl", [{"messages": parts}]) == _examples(tmp_path, "m.jsonl",
                                                                                  [{"messages": plain}])


U, A = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def _asks(args):
    return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": args}}]}


# (case, the third record of chat.jsonl, what its one line says after "chat.jsonl:3: ")
BAD = [
    ("an image part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE]}, A]},
     "messages[0].content[1]: a part of type 'image_url': shardfit trains on text parts only; fix: leave the record "
     "out, or give the part's content as text"),
    ("an audio part in a completion", {"prompt": [U], "completion": [
        {"role": "assistant", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "completion[0].content[0]: a part of type 'input_audio'"),
    ("a part without a type", {"messages": [{"role": "user", "content": [{"text": "x"}]}, A]},
     "messages[0].content[0]: a part without a 'type', not a content part"),
    ("a text part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}, A]},
     "messages[0].content[0].text: missing"),
    ("content a number", {"messages": [U, {"role": "assistant", "content": 4}]},
     "messages[1].content: a JSON number, not a string or a list of parts"),
    ("content null without calls", {"messages": [U, {"role": "assistant", "content": None}]},
     "messages[1].content: missing or null, and the message has no tool_calls; fix: give the message's text as "
     "content (null only beside tool_calls)"),
    ("no role", {"messages": [{"content": "q"}, A]}, "messages[0].role: missing"),
    ("a message that is a string", {"messages": [U, "a"]}, "messages[1]: a JSON string, not a message object"),
    ("no messages", {"messages": []}, "messages: an empty array, not a list of messages"),
    ("arguments that are not JSON", {"messages": [U, _asks("{city: Paris}")]},
     "messages[1].tool_calls[0].function.arguments: not JSON (Expecting property name enclosed in double quotes)"),
    ("arguments that are a JSON array", {"messages": [U, _asks("[1]")]},
     "messages[1].tool_calls[0].function.arguments: a JSON array, not an object"),
    ("a call without a name", {"messages": [U, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"arguments": {}}}]}]}, "messages[1].tool_calls[0].function.name: missing"),
    ("tool_calls not a list", {"messages": [U, {"role": "assistant", "tool_calls": {"name": "f"}}]},
     "messages[1].tool_calls: a JSON object, not a list of calls"),
    ("a tool_call_id that is a number", {"messages": [U, _asks({}), {"role": "tool", "tool_call_id": 7,
                                                                    "content": "18"}, A]},
     "messages[2].tool_call_id: a JSON number, not a string"),
    ("a function_call that is not JSON", {"conversations": [{"from": "human", "value": "q"},
                                                            {"from": "function_call", "value": "get_weather(Paris)"}]},
     "conversations[1].value: a function_call's value is not JSON (Expecting value)"),
    ("a function_call list with a nameless call", {"conversations": [
        {"from": "human", "value": "q"},
        {"from": "function_call", "value": json.dumps([{"name": "f", "arguments": {}}, {"arguments": {}}])}]},
     "conversations[1].value[1].name: missing"),
    ("tools not a list", {"messages": [U, A], "tools": {"name": "f"}},
     "tools: a JSON object, not a list of tool schemas"),
    ("tools text that is not JSON", {"messages": [U, A], "tools": "[{"},
     "tools: a string that is not JSON (Expecting property name enclosed in double quotes)"),
    ("a tool that is a string", {"messages": [U, A], "tools": [WEATHER, "get_time"]},
     "tools[1]: a JSON string, not a tool schema (an object)"),
    ("tools on prompt/completion strings", {"prompt": "q", "completion": "a", "tools": [WEATHER]},
     "tools: a prompt/completion record of strings has no chat template to render them in; fix: write the record as "
     "messages, or drop 'tools'"),
]


@pytest.mark.parametrize("case, record, said", BAD, ids=[b[0] for b in BAD])
def test_bad_messages_name_the_line_the_message_and_the_field(tmp_path, qwen, case, record, said):
    if "messages" in record:  # two good records of the same layout first
        first = {"messages": [U, A]}
    elif "conversations" in record:
        first = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    else:
        first = {"prompt": "q", "completion": "a"} if isinstance(record["prompt"], str) else {"prompt": [U],
                                                                                             "completion": [A]}
    with pytest.raises(ShardfitError) as e:
        _examples(tmp_path, "chat.jsonl", [first, first, record], qwen)
    assert str(e.value).startswith(f"{tmp_path / 'chat.jsonl'}:3: {said}"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_known_speaker_list_names_function_call(tmp_path):
    with pytest.raises(ShardfitError, match=re.escape("conversations[0].from: 'bot' is not a known speaker; fix: use "
                                                      "one of human, user, gpt, assistant, model, chatgpt, "
                                                      "function_call, system, tool, function, observation")):
        _examples(tmp_path, "d.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}])
