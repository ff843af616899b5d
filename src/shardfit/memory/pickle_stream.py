"""A pickle reader for memory snapshots that stores trace events compactly as it reads them.

Why not `pickle.load`: a snapshot of 1,000,000 events is ~50 MB on disk (stacks are shared through the pickle memo)
but ~600 MB as Python dicts (one dict, three large ints and a list per event). This reader interprets the pickle
opcodes itself (the subset plain data uses, protocols 2-5) and, whenever a batch of event dicts is appended to a
list, stores them in typed columns (`EventTrace`: ~41 bytes an event) with their stacks interned, instead of keeping
the dicts. Everything else is built as usual.

It is also safe by construction: it has no opcode that names a Python global or calls anything (GLOBAL,
STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, EXT*, PERSID are refused), so a malicious file runs nothing. A
file that needs one of those (an older PyTorch writing OrderedDict, say) raises `NeedsFullUnpickler`, and the
caller falls back to `safe_pickle`'s allowlisting unpickler.
"""

from __future__ import annotations

from array import array
from struct import unpack_from

_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "snapshot", "oom")
_CODE = {a: i for i, a in enumerate(_ACTIONS)}
_STANDARD = {"action", "addr", "size", "stream", "time_us", "frames"}


class NeedsFullUnpickler(Exception):
    """The pickle uses an opcode this plain-data reader does not implement."""


class EventTrace:
    """Trace events in columns. Indexing or iterating gives each event back as a fresh dict (the keys the file
    had), so code written for lists of dicts works unchanged; nothing per event stays alive in between."""

    def __init__(self):
        self.action = array("B")
        self.addr = array("Q")
        self.size = array("Q")
        self.stream = array("Q")
        self.time_us = array("q")
        self.stack = array("I")  # index into self.stacks
        self.extra = array("I")  # index into self.extras (0: none)
        self.stacks: list[list] = []
        self.extras: list[dict] = [{}]
        self._stack_ids: dict[tuple, int] = {}
        self._extra_ids: dict[tuple, int] = {(): 0}

    def add(self, ev: dict) -> list:
        """Store one event; returns the interned frames list (the caller may point the memo at it)."""
        self.action.append(_CODE[ev["action"]])
        self.addr.append(ev.get("addr", 0))
        self.size.append(ev.get("size", 0))
        self.stream.append(ev.get("stream", 0))
        self.time_us.append(ev.get("time_us", 0))
        frames = ev.get("frames") or []
        key = tuple(map(id, frames))
        k = self._stack_ids.get(key)
        if k is None:
            k = self._stack_ids[key] = len(self.stacks)
            self.stacks.append(frames)
        self.stack.append(k)
        other = tuple((key, val) for key, val in ev.items() if key not in _STANDARD)
        e = self._extra_ids.get(other)
        if e is None:
            e = self._extra_ids[other] = len(self.extras)
            self.extras.append(dict(other))
        self.extra.append(e)
        return self.stacks[k]

    def __len__(self) -> int:
        return len(self.action)

    def __getitem__(self, j: int) -> dict:
        if j < 0:
            j += len(self)
        return {"action": _ACTIONS[self.action[j]], "addr": self.addr[j], "size": self.size[j],
                "stream": self.stream[j], "time_us": self.time_us[j], "frames": self.stacks[self.stack[j]],
                **self.extras[self.extra[j]]}

    def __iter__(self):
        for j in range(len(self)):
            yield self[j]

    @staticmethod
    def accepts(ev) -> bool:
        return type(ev) is dict and ev.get("action") in _CODE and all(
            type(ev.get(k, 0)) is int and 0 <= ev.get(k, 0) < 1 << 64 for k in ("addr", "size", "stream")) and type(
            ev.get("time_us", 0)) is int and type(ev.get("frames", [])) is list


def _long(b: bytes) -> int:
    return int.from_bytes(b, "little", signed=True)


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogatepass")


# opcode -> (format of its length, the length's width, how to turn the bytes into the value)
_SIZED = {0x8A: ("<B", 1, _long), 0x8B: ("<i", 4, _long), 0x8C: ("<B", 1, _text), 0x58: ("<I", 4, _text),
          0x8D: ("<Q", 8, _text), 0x43: ("<B", 1, bytes), 0x42: ("<I", 4, bytes)}


class _Mark:
    pass


def load_plain(data: bytes):
    """Unpickle plain data (dicts, lists, tuples, sets, str, bytes, numbers, bool, None). Lists of trace events
    come back as empty lists whose events are in the returned map {id(list): EventTrace}."""
    mark = _Mark()
    stack: list = []
    marks: list[int] = []
    memo: list = []  # indices are dense (MEMOIZE appends); a list costs 8 bytes an entry, a dict ~5x that
    traces: dict[int, EventTrace] = {}
    pos, n = 0, len(data)
    push, pop = stack.append, stack.pop

    def pop_mark() -> list:
        k = marks.pop()
        items = stack[k + 1:]
        del stack[k:]
        return items

    def memoize(idx: int) -> None:
        if idx == len(memo):
            memo.append(stack[-1])
        else:
            memo.extend([None] * (idx + 1 - len(memo)))
            memo[idx] = stack[-1]

    def extend(target: list, items: list) -> None:
        if items and type(target) is list and not target and all(EventTrace.accepts(x) for x in items):
            trace = traces.get(id(target))
            if trace is None:
                trace = traces[id(target)] = EventTrace()
            # The batch's events and their frames lists were memoized just before: find their memo slots in the
            # recent window and repoint them (an event to None: nothing refers back to one in a snapshot; a frames
            # list to its interned equal), so that the per-event objects can go.
            lo = max(0, len(memo) - 6 * len(items) - 64)
            slot = {id(memo[i]): i for i in range(lo, len(memo))}
            for ev in items:
                frames = ev.get("frames")
                canonical = trace.add(ev)
                i = slot.get(id(frames)) if frames is not None else None
                if i is not None and memo[i] is frames:
                    memo[i] = canonical
                i = slot.get(id(ev))
                if i is not None and memo[i] is ev:
                    memo[i] = None
            return
        if id(target) in traces:
            raise NeedsFullUnpickler("a list mixes trace events and other items")
        target.extend(items)

    while pos < n:
        op = data[pos]
        pos += 1
        if op == 0x68:  # BINGET
            push(memo[data[pos]])
            pos += 1
        elif op == 0x6A:  # LONG_BINGET
            push(memo[unpack_from("<I", data, pos)[0]])
            pos += 4
        elif op == 0x94:  # MEMOIZE
            memoize(len(memo))
        elif op == 0x28:  # MARK
            marks.append(len(stack))
            push(mark)
        elif op == 0x7D:  # EMPTY_DICT
            push({})
        elif op == 0x75:  # SETITEMS
            items = pop_mark()
            d = stack[-1]
            for i in range(0, len(items), 2):
                d[items[i]] = items[i + 1]
        elif op == 0x4D:  # BININT2
            push(data[pos] | data[pos + 1] << 8)
            pos += 2
        elif op == 0x4B:  # BININT1
            push(data[pos])
            pos += 1
        elif op == 0x4A:  # BININT
            push(unpack_from("<i", data, pos)[0])
            pos += 4
        elif op == 0x5D:  # EMPTY_LIST
            push([])
        elif op == 0x65:  # APPENDS
            items = pop_mark()
            extend(stack[-1], items)
        elif op == 0x61:  # APPEND
            item = pop()
            extend(stack[-1], [item])
        elif op == 0x73:  # SETITEM
            v, k = pop(), pop()
            stack[-1][k] = v
        elif op in _SIZED:  # a length, then that many bytes: LONG1/4, (SHORT_)BINUNICODE(8), (SHORT_)BINBYTES
            fmt, width, convert = _SIZED[op]
            k = unpack_from(fmt, data, pos)[0]
            push(convert(data[pos + width:pos + width + k]))
            pos += width + k
        elif op == 0x71:  # BINPUT
            memoize(data[pos])
            pos += 1
        elif op == 0x72:  # LONG_BINPUT
            memoize(unpack_from("<I", data, pos)[0])
            pos += 4
        elif op == 0x47:  # BINFLOAT
            push(unpack_from(">d", data, pos)[0])
            pos += 8
        elif op == 0x88:  # NEWTRUE
            push(True)
        elif op == 0x89:  # NEWFALSE
            push(False)
        elif op == 0x4E:  # NONE
            push(None)
        elif op == 0x29:  # EMPTY_TUPLE
            push(())
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x86:  # TUPLE2
            stack[-2:] = [tuple(stack[-2:])]
        elif op == 0x87:  # TUPLE3
            stack[-3:] = [tuple(stack[-3:])]
        elif op == 0x74:  # TUPLE
            push(tuple(pop_mark()))
        elif op == 0x6C:  # LIST
            push(pop_mark())
        elif op == 0x64:  # DICT
            items = pop_mark()
            push({items[i]: items[i + 1] for i in range(0, len(items), 2)})
        elif op == 0x8F:  # EMPTY_SET
            push(set())
        elif op == 0x90:  # ADDITEMS
            items = pop_mark()
            stack[-1].update(items)
        elif op == 0x91:  # FROZENSET
            push(frozenset(pop_mark()))
        elif op == 0x30:  # POP
            if stack and stack[-1] is mark:
                marks.pop()
            pop()
        elif op == 0x31:  # POP_MARK
            pop_mark()
        elif op == 0x32:  # DUP
            push(stack[-1])
        elif op == 0x95:  # FRAME: an 8-byte length; frames need no handling when the whole file is in memory
            pos += 8
        elif op == 0x80:  # PROTO
            pos += 1
        elif op == 0x2E:  # STOP
            if len(stack) != 1:
                raise ValueError("malformed pickle: stack not empty at STOP")
            return stack[0], traces
        else:
            raise NeedsFullUnpickler(f"opcode 0x{op:02x} at byte {pos - 1}")
    raise EOFError("pickle data was truncated")
