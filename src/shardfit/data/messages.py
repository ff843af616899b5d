"""Chat messages as users have them: checked, and made into what chat templates read (data/chat.py renders them).

A message is {"role", "content", ...}. Beyond plain strings, shardfit reads what the OpenAI API returns and its
exports hold, in the form transformers' `apply_chat_template(messages, tools=tools)` takes it:

  content parts     content as a list of parts: the text parts' texts joined with "\\n" (what vLLM hands a template
                    that reads strings); any other part (image_url, input_audio, file, refusal...) is refused by its
                    type: shardfit trains on text
  tool calls        an assistant turn with "content": null and "tool_calls": [{"id", "type": "function",
                    "function": {"name", "arguments"}}] (or HF's {"name", "arguments"} calls). Keys whose value is
                    null are dropped, as transformers 5 does before rendering (templates test `message.content`, not
                    for null). OpenAI writes arguments as a JSON string; it is parsed into the object the templates
                    expect (they write it with `| tojson`: a string would be trained as a quoted, escaped string)
  tool results      the tool role, with its tool_call_id, as given
  ShareGPT          the function_call speaker (its value the call as JSON, {"name", "arguments"}, or a list of
                    calls) becomes an assistant turn with tool_calls; observation (and tool, function) the tool role
  tools             a record's top-level "tools": a list of JSON schemas (OpenAI's {"type": "function",
                    "function": {...}}), or that list as a JSON string (LLaMA-Factory writes it so), passed to the
                    template as `tools`

Every refusal is one line naming the record's file:line, the message's index and the field, as a JSON path:
`chat.jsonl:12: messages[3].content[1]: a part of type 'image_url' ...`. Torch-free (the config loader's detection
reads records through data/formats.py).
"""

from __future__ import annotations

import json

from shardfit.errors import ShardfitError

# ShareGPT speakers (the names its public sets use) -> chat roles; function_call turns are calls (sharegpt_turn)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "function_call": "assistant", "system": "system", "tool": "tool",
                  "function": "tool", "observation": "tool"}
_MESSAGE_FIX = "write each message as {\"role\": ..., \"content\": \"...\"} (OpenAI's chat layout)"


def json_type(value: object) -> str:
    """A value's type as JSON names it, for error lines."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def check_messages(msgs: object, key: str, where: str) -> list[dict]:
    """The record's `key` (a non-empty list of messages) as messages templates read, each checked."""
    if not isinstance(msgs, list) or not msgs:
        found = "an empty array" if isinstance(msgs, list) else f"a JSON {json_type(msgs)}"
        raise ShardfitError(f"{key}: {found}, not a list of messages", where=where,
                            fix="one conversation per record: a list of {\"role\", \"content\"} messages")
    return [check_message(m, f"{key}[{i}]", where) for i, m in enumerate(msgs)]


def check_message(msg: object, at: str, where: str) -> dict:
    """One message (at: its JSON path, e.g. messages[3]) with null keys dropped, content as text, calls checked."""
    if not isinstance(msg, dict):
        raise ShardfitError(f"{at}: a JSON {json_type(msg)}, not a message object", where=where, fix=_MESSAGE_FIX)
    msg = {k: v for k, v in msg.items() if v is not None}
    if not isinstance(msg.get("role"), str) or not msg["role"]:
        found = "missing" if "role" not in msg else f"a JSON {json_type(msg['role'])}, not a role name"
        raise ShardfitError(f"{at}.role: {found}", where=where, fix=_MESSAGE_FIX)
    if "tool_calls" in msg:
        msg["tool_calls"] = tool_calls(msg["tool_calls"], f"{at}.tool_calls", where)
    if "content" in msg:
        msg["content"] = content_text(msg["content"], f"{at}.content", where)
    elif not msg.get("tool_calls"):
        raise ShardfitError(f"{at}.content: missing or null, and the message has no tool_calls", where=where,
                            fix="give the message's text as content (null only beside tool_calls)")
    if "tool_call_id" in msg and not isinstance(msg["tool_call_id"], str):
        raise ShardfitError(f"{at}.tool_call_id: a JSON {json_type(msg['tool_call_id'])}, not a string",
                            where=where, fix="give the id of the call this result answers, as a string")
    return msg


def content_text(content: object, at: str, where: str) -> str:
    """A message's content as text: a string as it is, a list of parts as its text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ShardfitError(f"{at}: a JSON {json_type(content)}, not a string or a list of parts", where=where,
                            fix="give the content as a string, or as [{\"type\": \"text\", \"text\": ...}, ...]")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "text":
            found = "missing" if "text" not in part else f"a JSON {json_type(part['text'])}, not a string"
            raise ShardfitError(f"{at}[{j}].text: {found}", where=where, fix="give a text part's text as a string")
        elif not isinstance(part, dict) or not isinstance(kind, str):
            found = f"a JSON {json_type(part)}" if not isinstance(part, dict) else "a part without a 'type'"
            raise ShardfitError(f"{at}[{j}]: {found}, not a content part", where=where,
                                fix="write each part as {\"type\": \"text\", \"text\": ...}")
        else:
            raise ShardfitError(f"{at}[{j}]: a part of type '{kind}': shardfit trains on text parts only",
                                where=where, fix="leave the record out, or give the part's content as text")
    return "\n".join(texts)


def tool_calls(calls: object, at: str, where: str) -> list[dict]:
    """An assistant turn's tool_calls, each call's arguments an object (a JSON string parsed)."""
    if not isinstance(calls, list):
        raise ShardfitError(f"{at}: a JSON {json_type(calls)}, not a list of calls", where=where,
                            fix="give tool_calls as [{\"type\": \"function\", \"function\": {\"name\", "
                                "\"arguments\"}}, ...]")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise ShardfitError(f"{at}[{j}]: a JSON {json_type(call)}, not a call", where=where,
                                fix="give each call as {\"type\": \"function\", \"function\": {\"name\", "
                                    "\"arguments\"}}")
        if "function" in call:  # OpenAI's layout
            out.append({**call, "function": function_call(call["function"], f"{at}[{j}].function", where)})
        else:  # transformers' own: {"name", "arguments"}
            out.append(function_call(call, f"{at}[{j}]", where))
    return out


def function_call(fn: object, at: str, where: str) -> dict:
    """A call's {"name", "arguments"}, arguments as an object."""
    if not isinstance(fn, dict):
        raise ShardfitError(f"{at}: a JSON {json_type(fn)}, not a call's {{name, arguments}}", where=where,
                            fix="give the call as {\"name\": ..., \"arguments\": {...}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        found = "missing" if "name" not in fn else f"a JSON {json_type(fn['name'])}, not a function's name"
        raise ShardfitError(f"{at}.name: {found}", where=where, fix="give the called function's name")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            raise ShardfitError(f"{at}.arguments: not JSON ({getattr(e, 'msg', e)})", where=where,
                                fix="give the arguments as an object, or as its JSON text") from None
    if not isinstance(args, dict):
        found = "missing" if "arguments" not in fn else f"a JSON {json_type(args)}, not an object"
        raise ShardfitError(f"{at}.arguments: {found}", where=where,
                            fix="give the arguments as an object ({} for none), or as its JSON text")
    return {**fn, "arguments": args}


def sharegpt_turn(turn: object, at: str, where: str) -> dict:
    """One ShareGPT turn as a message: {from, value} (function_call: an assistant turn of tool_calls), or a
    messages-style {role, content} turn."""
    if isinstance(turn, dict) and "role" in turn and "from" not in turn:
        return check_message(turn, at, where)
    if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
        found = (", ".join(sorted(map(str, turn))) or "none") if isinstance(turn, dict) else \
            f"a JSON {json_type(turn)}"
        raise ShardfitError(f"{at}: needs 'from' and 'value' strings (found: {found})", where=where,
                            fix="write each turn as {\"from\": \"human\"|\"gpt\", \"value\": ...}")
    speaker = turn["from"].lower()
    role = SHAREGPT_ROLES.get(speaker)
    if role is None:
        raise ShardfitError(f"{at}.from: '{turn['from']}' is not a known speaker", where=where,
                            fix="use one of " + ", ".join(SHAREGPT_ROLES))
    weight = {"weight": turn["weight"]} if "weight" in turn else {}
    if speaker != "function_call":
        return {"role": role, "content": turn["value"], **weight}
    try:
        calls = json.loads(turn["value"])
    except ValueError as e:
        raise ShardfitError(f"{at}.value: a function_call's value is not JSON ({getattr(e, 'msg', e)})",
                            where=where, fix="write the call as JSON: {\"name\": ..., \"arguments\": {...}}") from None
    one = not isinstance(calls, list)
    calls = [calls] if one else calls
    checked = [function_call(c, f"{at}.value" if one else f"{at}.value[{j}]", where) for j, c in enumerate(calls)]
    if not checked:
        raise ShardfitError(f"{at}.value: an empty list of calls", where=where, fix="give at least one call")
    return {"role": role, "tool_calls": [{"type": "function", "function": c} for c in checked], **weight}


def record_tools(obj: dict, where: str) -> list[dict] | None:
    """The record's top-level "tools" (None without them): a list of tool schemas, or that list as JSON text."""
    tools = obj.get("tools")
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise ShardfitError(f"tools: a string that is not JSON ({getattr(e, 'msg', e)})", where=where,
                                fix="give tools as a list of JSON schemas, or as its JSON text") from None
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ShardfitError(f"tools: a JSON {json_type(tools)}, not a list of tool schemas", where=where,
                            fix="give tools as [{\"type\": \"function\", \"function\": {\"name\", \"description\", "
                                "\"parameters\"}}, ...]")
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ShardfitError(f"tools[{j}]: a JSON {json_type(tool)}, not a tool schema (an object)", where=where,
                                fix="give each tool as {\"type\": \"function\", \"function\": {...}}")
    return tools
