"""Record layouts of fine-tuning data (data.format): which keys a record holds, detected or chosen, and the example
each becomes.

  messages           {"messages": [{"role", "content"}, ...], "tools"?} (OpenAI chat: tool calls, tool results
                     and content parts as data/messages.py reads them)
  sharegpt           {"conversations": [{"from": "human"|"gpt"|"system"|"function_call"|"observation", "value"},
                     ...], "system"?, "tools"?}; turns written as {"role", "content"} are accepted too
  alpaca             {"instruction", "input"?, "output", "system"?}: instruction + input is the user turn, output the
                     assistant's
  prompt_completion  {"prompt", "completion"}: strings are trained as they are (prompt + completion + EOS, no chat
                     template); lists of messages (TRL's conversational form) are a chat of prompt then completion
  text               documents in data.text_field: pretraining, not examples
  preference         TRL's preference pairs: {"prompt"?, "chosen", "rejected"}; trained by preference.objective
                     (data/preference.py), refused by fine-tuning with that fix
  unpaired           TRL's unpaired preference: {"prompt", "completion", "label": true|false}; trained by
                     preference.objective=kto (data/unpaired.py), refused by fine-tuning with that fix

data.format=auto takes the layout of data.path's first record (data.val_path: its own first record) for every
record; a record of another layout is one error naming its file:line and the key it lacks. Chats (messages,
sharegpt, alpaca, conversational prompt/completion) become messages here (each message checked by
data/messages.py, which also reads a record's "tools"); data/chat.py renders them. Torch-free: the config loader
asks `file_format` without importing the training stack.
"""

from __future__ import annotations

from pathlib import Path

from shardfit.data.messages import check_messages, json_type, record_tools, sharegpt_turn
from shardfit.data.sources import read_records
from shardfit.errors import ShardfitError

LAYOUT = {"messages": "'messages': [{role, content}, ...]", "sharegpt": "'conversations': [{from, value}, ...]",
          "alpaca": "'instruction', 'input' (optional), 'output'", "prompt_completion": "'prompt', 'completion'",
          "text": "the text in data.text_field", "preference": "'prompt' (optional), 'chosen', 'rejected'",
          "unpaired": "'prompt', 'completion', 'label'"}


def detect(obj: object) -> str:
    """The layout a record's keys say (text when none of the fine-tuning layouts')."""
    if not isinstance(obj, dict):
        return "text"
    if "chosen" in obj and "rejected" in obj:
        return "preference"
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    if "prompt" in obj and "completion" in obj:
        return "unpaired" if "label" in obj else "prompt_completion"
    return "text"


def file_format(path: Path, file_fmt: str = "auto") -> tuple[str, str] | None:
    """(layout of the file's first record, that record's file:line), or None for a file of plain text or with no
    record. Unreadable first records count as text: the reader reports them with their reason."""
    try:
        for obj, where in read_records(path, file_fmt, first_only=True):
            return detect(obj), where
    except ShardfitError:
        return None
    return None


def is_sft_file(path: Path, file_fmt: str = "auto") -> bool:
    found = file_format(path, file_fmt)
    return found is not None and found[0] != "text"


def _keys(obj: dict) -> str:
    return ", ".join(sorted(map(str, obj))) or "none"


def _missing(obj: dict, key: str, fmt: str, origin: str, where: str) -> ShardfitError:
    other = detect(obj)
    seen = f", a record of {other}" if other not in ("text", fmt) else ""
    origin = origin.replace(f"from {where.rpartition(':')[0]}:", "from line ")  # the same file: its line
    return ShardfitError(f"no '{key}' key (found: {_keys(obj)}{seen}) but data.format is {fmt} ({origin})",
                         where=where, fix=f"write every record as {fmt} ({LAYOUT[fmt]})")


def _sharegpt(obj: dict, where: str) -> list[dict]:
    turns = obj["conversations"]
    if not isinstance(turns, list) or not turns:
        found = "an empty array" if isinstance(turns, list) else f"a JSON {json_type(turns)}"
        raise ShardfitError(f"conversations: {found}, not a list of {{from, value}} turns", where=where,
                            fix="one conversation per record")
    system = obj.get("system")
    msgs = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    return msgs + [sharegpt_turn(turn, f"conversations[{i}]", where) for i, turn in enumerate(turns)]


def _alpaca(obj: dict, where: str) -> list[dict]:
    for key in ("instruction", "input", "output", "system"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise ShardfitError(f"'{key}' is {type(obj[key]).__name__}, not a string", where=where,
                                fix="store instruction, input and output as strings")
    user = obj["instruction"] + (f"\n\n{obj['input']}" if obj.get("input") else "")
    system = [{"role": "system", "content": obj["system"]}] if obj.get("system") else []
    return [*system, {"role": "user", "content": user}, {"role": "assistant", "content": obj["output"]}]


def _prompt_completion(obj: dict, where: str) -> list[dict] | list[tuple[str | None, bool]]:
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return [(prompt, False), (completion, True), (None, True)]  # None: EOS, trained
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational: loss on the completion only
        head = [{**m, "weight": 0} if isinstance(m, dict) and m.get("role") == "assistant" else m
                for m in check_messages(prompt, "prompt", where)]
        return head + check_messages(completion, "completion", where)
    raise ShardfitError(f"'prompt' is {type(prompt).__name__} and 'completion' {type(completion).__name__}",
                        where=where, fix="give two strings, or two lists of {role, content} messages")


REQUIRED = {"messages": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
            "prompt_completion": ("prompt", "completion")}


CHAT = ("messages", "sharegpt", "alpaca")  # the layouts whose records are conversations


def chat_messages(obj: dict, fmt: str, where: str) -> list[dict]:
    """A conversation record of a CHAT layout as {role, content} messages, checked (no assistant turn needed)."""
    if fmt == "messages":
        return check_messages(obj["messages"], "messages", where)
    return _sharegpt(obj, where) if fmt == "sharegpt" else _alpaca(obj, where)


def to_example(obj: object, fmt: str, origin: str, where: str) -> list[dict] | list[tuple[str | None, bool]]:
    """A record of layout `fmt` as messages (a chat) or (text, trained) pieces (prompt/completion strings; text
    None is EOS). origin says where fmt came from, for the error line of a record that lacks a key of it."""
    if not isinstance(obj, dict):
        raise ShardfitError(f"line is a JSON {type(obj).__name__}, not an object", where=where,
                            fix="one JSON object per line")
    for key in REQUIRED[fmt]:
        if key not in obj:
            raise _missing(obj, key, fmt, origin, where)
    if fmt in CHAT:
        msgs = chat_messages(obj, fmt, where)
    else:
        msgs = _prompt_completion(obj, where)
        if isinstance(msgs[0], tuple):
            if record_tools(obj, where):
                raise ShardfitError("tools: a prompt/completion record of strings has no chat template to render "
                                    "them in", where=where, fix="write the record as messages, or drop 'tools'")
            return msgs
    if not any(m["role"] == "assistant" and m.get("weight", 1) != 0 for m in msgs):
        raise ShardfitError("conversation has no assistant message to learn from", where=where,
                            fix="give every conversation an assistant turn, or leave the record out")
    return msgs
