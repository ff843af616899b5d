"""The shape of a CUDA memory snapshot, checked once where it is loaded, so that the replay and the diagnosis can
index it without guarding every access.

A file of the right format can still hold the wrong thing: a dict where the segments list belongs, a size that is a
string or negative, an event without its action. Each is refused here as one line naming the field (`segments[3]
.blocks[0].size`) instead of a TypeError deep in replay.py. The walk follows the schema top-down, a fixed few levels
deep, and visits each shared frames list once: a value nested where a scalar belongs is refused by its type without
being walked, and keys the replay never reads are not looked at. Sizes and addresses are whole numbers in [0, 2^64);
all sizes together stay below 2^62, so that the replay's running totals (int64 arrays) cannot overflow. Optional keys
missing in older PyTorch versions get the neutral defaults the replay expects.
"""

from __future__ import annotations

from shardfit.doctor.limits import a_type
from shardfit.doctor.pickle_stream import EventTrace
from shardfit.errors import ShardfitError

_U64 = 1 << 64
_TOTAL = 1 << 62
FIX = "pass the file torch.cuda.memory._dump_snapshot() wrote (this one is damaged or was edited)"


class _Checker:
    def __init__(self, path: str):
        self.path = path
        self.seen: set[int] = set()  # ids of frames lists already checked (stacks are shared through the memo)
        self.total = 0  # every size, added up

    def fail(self, field: str, problem: str) -> ShardfitError:
        return ShardfitError(f"{field} {problem}", where=self.path, fix=FIX)

    def kind(self, value, want: type, field: str, what: str):
        if type(value) is not want and not (want is dict and isinstance(value, dict)):  # OrderedDict: older files
            raise self.fail(field, f"is {a_type(value)}, not {what}")
        return value

    def size(self, value, field: str) -> int:
        """A byte count or an address: a whole number in [0, 2^64)."""
        if type(value) is not int:
            raise self.fail(field, f"is {a_type(value)}, not a whole number of bytes")
        if not 0 <= value < _U64:
            raise self.fail(field, f"is {value if abs(value) < 1 << 80 else 'huge'}, outside [0, 2^64)")
        return value

    def required_sizes(self, d: dict, keys: tuple[str, ...], field: str) -> None:
        for key in keys:
            if key not in d:
                raise self.fail(field, f"has no '{key}'")
            self.size(d[key], f"{field}.{key}")

    def add(self, n: int, field: str) -> None:
        self.total += n
        if self.total >= _TOTAL:
            raise self.fail(field, "brings the sizes in the file to more than 2^62 bytes, which no GPU has")

    def optional(self, d: dict, key: str, default, check, field: str):
        value = d.get(key, default)
        if value is not default:
            check(value, f"{field}.{key}")
        return value

    def text(self, value, field: str) -> str:
        return self.kind(value, str, field, "text")

    def frames(self, value, field: str) -> list:
        frames = self.kind(value, list, field, "a list of stack frames")
        if id(frames) in self.seen:
            return frames
        for i, f in enumerate(frames):
            self.kind(f, dict, f"{field}[{i}]", "a stack frame (a dict)")
            for key in ("name", "filename"):
                if key in f:
                    self.text(f[key], f"{field}[{i}].{key}")
            if type(f.get("line", 0)) not in (int, str):
                raise self.fail(f"{field}[{i}].line", f"is {a_type(f['line'])}, not a line number")
        self.seen.add(id(frames))
        return frames


def check_snapshot(data, compact: dict[int, EventTrace], path: str) -> dict:
    """The snapshot's parts, checked and with defaults filled in: segments, traces (one per device: an EventTrace or
    a list of event dicts), allocator_settings, annotations, shardfit. Raises ShardfitError naming the field."""
    c = _Checker(path)
    if isinstance(data, list):  # legacy: torch.cuda.memory_snapshot() output, segments only
        data = {"segments": data}
    if type(data) is not dict or "segments" not in data:
        raise ShardfitError(f"not a CUDA memory snapshot ({a_type(data)} without a 'segments' list)",
                            where=path, fix="pass the file torch.cuda.memory._dump_snapshot() wrote")
    segments = c.kind(data["segments"], list, "segments", "a list of segments")
    for i, s in enumerate(segments):
        _segment(c, s, f"segments[{i}]")
    traces = data.get("device_traces")
    traces = [] if traces is None else c.kind(traces, list, "device_traces", "a list (one trace per device)")
    out = []
    for d, t in enumerate(traces):
        field = f"device_traces[{d}]"
        if t is None:
            out.append([])
        elif type(t) is list and id(t) in compact:
            out.append(_compact_trace(c, compact[id(t)], field))
        else:
            out.append(_plain_trace(c, c.kind(t, list, field, "a list of events"), field))
    settings = data.get("allocator_settings") or {}
    c.kind(settings, dict, "allocator_settings", "a dict")
    c.optional(settings, "PYTORCH_CUDA_ALLOC_CONF", None, c.text, "allocator_settings")
    annotations = data.get("external_annotations") or []
    for i, a in enumerate(c.kind(annotations, list, "external_annotations", "a list")):
        field = f"external_annotations[{i}]"
        c.kind(a, dict, field, "an annotation (a dict)")
        c.optional(a, "time_us", 0, lambda v, f: c.kind(v, int, f, "a time in microseconds"), field)
        for key in ("stage", "name"):
            c.optional(a, key, None, c.text, field)
    extra = data.get("shardfit")
    return {"segments": segments, "traces": out, "allocator_settings": settings, "annotations": annotations,
            "shardfit": extra if isinstance(extra, dict) else {}}


def _segment(c: _Checker, s, field: str) -> None:
    c.kind(s, dict, field, "a segment (a dict)")
    c.required_sizes(s, ("total_size", "address"), field)
    c.add(s["total_size"], f"{field}.total_size")
    s.setdefault("device", 0)
    s.setdefault("stream", 0)
    c.size(s["device"], f"{field}.device")
    c.size(s["stream"], f"{field}.stream")
    s.setdefault("segment_type", "large" if s["total_size"] > (1 << 20) else "small")
    s.setdefault("is_expandable", False)
    c.frames(s.setdefault("frames", []), f"{field}.frames")
    blocks = c.kind(s.setdefault("blocks", []), list, f"{field}.blocks", "a list of blocks")
    for j, b in enumerate(blocks):
        where = f"{field}.blocks[{j}]"
        c.kind(b, dict, where, "a block (a dict)")
        c.required_sizes(b, ("size", "address"), where)
        c.add(b["size"], f"{where}.size")
        c.size(b.setdefault("requested_size", b["size"]), f"{where}.requested_size")
        c.text(b.setdefault("state", "active_allocated"), f"{where}.state")
        c.frames(b.setdefault("frames", []), f"{where}.frames")


def _compact_trace(c: _Checker, t: EventTrace, field: str) -> EventTrace:
    """Columns are typed as they are filled (pickle_stream): only the stacks and the extra keys need a look."""
    for k, frames in enumerate(t.stacks):  # named by the first event with that stack
        if id(frames) not in c.seen:
            c.frames(frames, f"{field}[{t.stack.index(k)}].frames")
    for k, extra in enumerate(t.extras):
        if "device_free" in extra:
            c.size(extra["device_free"], f"{field}[{t.extra.index(k)}].device_free")
    c.add(sum(t.size), f"{field} (the events' sizes)")
    return t


def _plain_trace(c: _Checker, events: list, field: str) -> list:
    for j, ev in enumerate(events):
        where = f"{field}[{j}]"
        c.kind(ev, dict, where, "an event (a dict)")
        if "action" not in ev:
            raise c.fail(where, "has no 'action'")
        c.text(ev["action"], f"{where}.action")
        for key in ("addr", "size", "stream", "device_free"):
            if key in ev:
                c.size(ev[key], f"{where}.{key}")
        c.add(ev.get("size", 0), f"{where}.size")
        t = ev.get("time_us", 0)
        if type(t) is not int or not -(1 << 63) <= t < 1 << 63:
            raise c.fail(f"{where}.time_us", f"is {'out of range' if type(t) is int else a_type(t)}, "
                         "not a time in microseconds")
        c.frames(ev.setdefault("frames", []), f"{where}.frames")
        ev.setdefault("stream", 0)
        ev.setdefault("size", 0)
    return events
