"""A pickle reader for memory snapshots that stores trace events compactly as it reads them (docs/doctor.md).

Why not `pickle.load`: a snapshot of 1,000,000 events is ~50 MB on disk (stacks are shared through the pickle memo)
but ~600 MB as Python dicts (one dict, three large ints and a list per event). This reader interprets the pickle
opcodes itself (the subset plain data uses, protocols 2-5) and, whenever a batch of event dicts is appended to a
list, stores them in typed columns (`EventTrace`: ~41 bytes an event) with their stacks interned.

Safe by construction: the only globals it resolves are the snapshot allowlist's containers
(`safe_pickle.SNAPSHOT_GLOBALS`), called only with plain arguments; any other global is refused (`RefusedGlobal`)
and INST, OBJ, BUILD, EXT*, PERSID are not implemented, so a malicious file runs nothing. Bounded (doctor/limits.py):
objects built and containers open at once are capped, memo indices must be dense, dict keys and set items must be
scalars (hashing a deep tuple would recurse in C), a length past the end of the data is a truncation. A malformed
stream raises `Malformed`, one line.
"""

from __future__ import annotations

import collections
from array import array
from struct import error as StructError
from struct import unpack_from

from shardfit.safe_pickle import SNAPSHOT_GLOBALS, RefusedGlobal

_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "snapshot", "oom")
_CODE = {a: i for i, a in enumerate(_ACTIONS)}
_STANDARD = {"action", "addr", "size", "stream", "time_us", "frames"}


class Malformed(ValueError):
    """The bytes are not a pickle of plain data that this reader can build: one line saying where and why."""


class OverLimit(Exception):
    """The pickle would build more than a cap allows (limits.py); found: what it reached."""

    def __init__(self, limit, found: str):
        super().__init__(found)
        self.limit, self.found = limit, found


_SCALARS = (str, int, float, bool, type(None), bytes)  # what a dict key, a set item or an event's extra may be
_CALLABLES = {("collections", "OrderedDict"): collections.OrderedDict, ("builtins", "set"): set,
              ("builtins", "frozenset"): frozenset}
assert set(_CALLABLES) <= SNAPSHOT_GLOBALS
_MODULES = {"__builtin__": "builtins"}  # protocol 2 names builtins the Python 2 way


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
        """Whether ev fits the columns; anything else (a negative size, a string address, an extra key holding a
        list) stays a plain dict, for the schema check (snapshot_schema.py) to name."""
        return type(ev) is dict and type(ev.get("action")) is str and ev["action"] in _CODE and all(
            type(ev.get(k, 0)) is int and 0 <= ev.get(k, 0) < 1 << 64 for k in ("addr", "size", "stream")) and type(
            ev.get("time_us", 0)) is int and -(1 << 63) <= ev.get("time_us", 0) < 1 << 63 and type(
            ev.get("frames", [])) is list and all(type(v) in _SCALARS for k, v in ev.items() if k not in _STANDARD)


def _long(b: bytes) -> int:
    return int.from_bytes(b, "little", signed=True)


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogatepass")


# opcode -> (format of its length, the length's width, how to turn the bytes into the value)
_SIZED = {0x8A: ("<B", 1, _long), 0x8B: ("<i", 4, _long), 0x8C: ("<B", 1, _text), 0x58: ("<I", 4, _text),
          0x8D: ("<Q", 8, _text), 0x43: ("<B", 1, bytes), 0x42: ("<I", 4, bytes)}


class _Mark:
    pass


def load_plain(data: bytes, max_objects: int = 1 << 62, max_depth: int = 1 << 62):
    """Unpickle plain data (dicts, lists, tuples, sets, str, bytes, numbers, bool, None). Lists of trace events
    come back as empty lists whose events are in the returned map {id(list): EventTrace}. max_objects caps the
    objects built, max_depth the containers open at once (OverLimit names which)."""
    try:
        return _load(data, max_objects, max_depth)
    except (IndexError, KeyError, TypeError, AttributeError, StructError, UnicodeDecodeError, OverflowError,
            EOFError) as e:
        # a container op on the wrong kind of object, a memo slot never written, a cut-off length field, ...
        raise Malformed(f"malformed pickle ({type(e).__name__}: {str(e)[:200]})") from None


def _scalar(x, what: str):
    if type(x) not in _SCALARS:
        raise Malformed(f"malformed pickle: a {what} of type {type(x).__name__} (a snapshot has only scalars there)")
    return x


def _call(func, args):
    """REDUCE / NEWOBJ: only the allowlisted containers, only with plain arguments (nothing else is callable)."""
    if not any(func is f for f in _CALLABLES.values()) or type(args) is not tuple or len(args) > 1:
        raise Malformed("malformed pickle: REDUCE of something other than an allowlisted container")
    items = args[0] if args else ()
    if func is collections.OrderedDict:
        if items:
            raise Malformed("malformed pickle: OrderedDict built from arguments")
        return func()
    if type(items) not in (list, tuple):
        raise Malformed(f"malformed pickle: {func.__name__} built from a {type(items).__name__}")
    return func(_scalar(x, "set item") for x in items)


def _global(module: str, name: str):
    module = _MODULES.get(module, module)
    if (module, name) not in _CALLABLES:
        raise RefusedGlobal(f"refused to load global '{module}.{name}'")
    return _CALLABLES[module, name]


def _load(data: bytes, max_objects: int, max_depth: int):
    mark = _Mark()
    stack: list = []
    marks: list[int] = []
    memo: list = []  # indices are dense (MEMOIZE appends); a list costs 8 bytes an entry, a dict ~5x that
    traces: dict[int, EventTrace] = {}
    pos, n = 0, len(data)
    push, pop = stack.append, stack.pop
    built = 0  # objects made (pushes of a new object): the bound on memory and time

    def pop_mark() -> list:
        k = marks.pop()
        items = stack[k + 1:]
        del stack[k:]
        return items

    def memoize(idx: int) -> None:
        if idx == len(memo):
            memo.append(stack[-1])
        elif idx < len(memo):
            memo[idx] = stack[-1]
        else:  # every pickler numbers its memo densely: a gap would make this list as long as the index
            raise Malformed(f"malformed pickle: memo index {idx} with {len(memo)} objects memoized (at byte {pos})")

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
        if type(target) is list and id(target) in traces:  # events, then something else: back to plain dicts
            target.extend(traces.pop(id(target)))
        target.extend(items)

    def set_items(d, items: list) -> None:
        if type(d) not in (dict, collections.OrderedDict):
            raise Malformed(f"malformed pickle: SETITEMS on a {type(d).__name__}")
        for i in range(0, len(items) - 1, 2):
            d[_scalar(items[i], "dict key")] = items[i + 1]

    while pos < n:
        op = data[pos]
        pos += 1
        if op == 0x68:  # BINGET
            push(memo[data[pos]])
            pos += 1
            continue
        if op == 0x6A:  # LONG_BINGET
            push(memo[unpack_from("<I", data, pos)[0]])
            pos += 4
            continue
        if op == 0x94:  # MEMOIZE
            memoize(len(memo))
            continue
        built += 1
        if built > max_objects:
            raise OverLimit("objects", f"the pickle builds {built:,} objects by byte {pos - 1:,}")
        if op == 0x28:  # MARK
            if len(marks) >= max_depth:
                raise OverLimit("depth", f"the pickle nests {len(marks) + 1:,} containers at byte {pos - 1:,}")
            marks.append(len(stack))
            push(mark)
        elif op == 0x7D:  # EMPTY_DICT
            push({})
        elif op == 0x75:  # SETITEMS
            items = pop_mark()
            set_items(stack[-1], items)
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
            if type(stack[-1]) is not list:
                raise Malformed(f"malformed pickle: APPENDS to a {type(stack[-1]).__name__} (at byte {pos - 1})")
            extend(stack[-1], items)
        elif op == 0x61:  # APPEND
            item = pop()
            if type(stack[-1]) is not list:
                raise Malformed(f"malformed pickle: APPEND to a {type(stack[-1]).__name__} (at byte {pos - 1})")
            extend(stack[-1], [item])
        elif op == 0x73:  # SETITEM
            v, k = pop(), pop()
            set_items(stack[-1], [k, v])
        elif op in _SIZED:  # a length, then that many bytes: LONG1/4, (SHORT_)BINUNICODE(8), (SHORT_)BINBYTES
            fmt, width, convert = _SIZED[op]
            k = unpack_from(fmt, data, pos)[0]
            if k < 0 or pos + width + k > n:  # a declared length past the end: cut off, or a lie; never allocated
                raise EOFError(f"pickle data was truncated (a length of {k:,} at byte {pos - 1})")
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
            if len(stack) < 2:
                raise IndexError("TUPLE2 on a short stack")
            stack[-2:] = [tuple(stack[-2:])]
        elif op == 0x87:  # TUPLE3
            if len(stack) < 3:
                raise IndexError("TUPLE3 on a short stack")
            stack[-3:] = [tuple(stack[-3:])]
        elif op == 0x74:  # TUPLE
            push(tuple(pop_mark()))
        elif op == 0x6C:  # LIST
            push(pop_mark())
        elif op == 0x64:  # DICT
            d: dict = {}
            set_items(d, pop_mark())
            push(d)
        elif op == 0x8F:  # EMPTY_SET
            push(set())
        elif op == 0x90:  # ADDITEMS
            items = pop_mark()
            if type(stack[-1]) is not set:
                raise Malformed(f"malformed pickle: ADDITEMS to a {type(stack[-1]).__name__}")
            stack[-1].update(_scalar(x, "set item") for x in items)
        elif op == 0x91:  # FROZENSET
            push(frozenset(_scalar(x, "set item") for x in pop_mark()))
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
        elif op == 0x63:  # GLOBAL: "module\nname\n" (protocols 2-3)
            end = data.find(b"\n", pos, pos + 256)
            end2 = data.find(b"\n", end + 1, end + 257) if end >= 0 else -1
            if end2 < 0:
                raise Malformed(f"malformed pickle: GLOBAL without its two lines (at byte {pos - 1})")
            push(_global(_text(data[pos:end]), _text(data[end + 1:end2])))
            pos = end2 + 1
        elif op == 0x93:  # STACK_GLOBAL (protocol 4+)
            name, module = pop(), pop()
            if type(module) is not str or type(name) is not str:
                raise Malformed("malformed pickle: STACK_GLOBAL of non-strings")
            push(_global(module, name))
        elif op in (0x52, 0x81):  # REDUCE, NEWOBJ: an allowlisted container only
            args = pop()
            stack[-1] = _call(stack[-1], args)
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or stack[0] is mark:
                raise Malformed("malformed pickle: stack not empty at STOP")
            return stack[0], traces
        else:
            raise Malformed(f"pickle opcode 0x{op:02x} at byte {pos - 1} is not one a memory snapshot uses")
    raise EOFError("pickle data was truncated")
