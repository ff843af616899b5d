"""`shardfit doctor` on files of the right format but the wrong contents, or of pathological size (issue 22, class
5): one line naming the file and the field, after bounded work."""

import copy
import gzip
import pickle
import struct
import time
import tracemalloc

import pytest

from shardfit.doctor import examine, load_snapshot
from shardfit.errors import ShardfitError
from tests.doctor.conftest import MB, ev, seg

FRAME = {"name": "forward", "filename": "torch/nn/modules/linear.py", "line": 7}


def _good() -> dict:
    return {"segments": [seg(0x1000000, 4 * MB, [(0, MB, "active_allocated", [FRAME])])],
            "device_traces": [[ev("segment_alloc", 0x1000000, 4 * MB), ev("alloc", 0x1000000, MB, frames=[FRAME])]],
            "allocator_settings": {"expandable_segments": False}, "external_annotations": []}


def _set(path: str, value):
    """A mutation of the good snapshot: path 'a.b.0.c' (list indices as numbers); value DELETE removes the key."""
    def mutate(d):
        keys = path.split(".")
        for k in keys[:-1]:
            d = d[int(k) if isinstance(d, list) else k]
        last = int(keys[-1]) if isinstance(d, list) else keys[-1]
        if value is DELETE:
            del d[last]
        else:
            d[last] = value
    return mutate


DELETE = object()
SEG, BLOCK, EVENT = "segments.0", "segments.0.blocks.0", "device_traces.0.1"

# (mutation, the words the one line must hold: the field and what is wrong with it)
WRONG_FIELDS = [
    (_set("segments", {"0": {}}), "segments is a dict, not a list"),
    (_set("segments", None), "segments is a NoneType"),
    (_set("segments", DELETE), "not a CUDA memory snapshot"),
    (_set(SEG, "segment"), r"segments\[0\] is a str, not a segment"),
    (_set(SEG + ".total_size", DELETE), r"segments\[0\] has no 'total_size'"),
    (_set(SEG + ".address", DELETE), r"segments\[0\] has no 'address'"),
    (_set(SEG + ".total_size", "4194304"), r"segments\[0\]\.total_size is a str, not a whole number"),
    (_set(SEG + ".total_size", -5), r"segments\[0\]\.total_size is -5, outside \[0, 2\^64\)"),
    (_set(SEG + ".total_size", 4.0 * MB), r"segments\[0\]\.total_size is a float"),
    (_set(SEG + ".total_size", True), r"segments\[0\]\.total_size is a bool"),
    (_set(SEG + ".total_size", 1 << 70), r"segments\[0\]\.total_size is 1180591620717411303424, outside"),
    (_set(SEG + ".total_size", 1 << 100), r"segments\[0\]\.total_size is huge, outside"),
    (_set(SEG + ".device", "0"), r"segments\[0\]\.device is a str"),
    (_set(SEG + ".stream", -1), r"segments\[0\]\.stream is -1"),
    (_set(SEG + ".blocks", None), r"segments\[0\]\.blocks is a NoneType, not a list of blocks"),
    (_set(SEG + ".blocks", {"a": 1}), r"segments\[0\]\.blocks is a dict"),
    (_set(SEG + ".frames", "x"), r"segments\[0\]\.frames is a str"),
    (_set(BLOCK, [1]), r"segments\[0\]\.blocks\[0\] is a list, not a block"),
    (_set(BLOCK + ".size", "1048576"), r"blocks\[0\]\.size is a str"),
    (_set(BLOCK + ".size", DELETE), r"blocks\[0\] has no 'size'"),
    (_set(BLOCK + ".address", None), r"blocks\[0\]\.address is a NoneType"),
    (_set(BLOCK + ".requested_size", -1), r"blocks\[0\]\.requested_size is -1"),
    (_set(BLOCK + ".state", 1), r"blocks\[0\]\.state is an int, not text"),
    (_set(BLOCK + ".frames", None), r"blocks\[0\]\.frames is a NoneType, not a list of stack frames"),
    (_set(BLOCK + ".frames", ["torch/nn"]), r"blocks\[0\]\.frames\[0\] is a str, not a stack frame"),
    (_set(BLOCK + ".frames.0.name", 3), r"frames\[0\]\.name is an int, not text"),
    (_set(BLOCK + ".frames.0.filename", ["x"]), r"frames\[0\]\.filename is a list"),
    (_set(BLOCK + ".frames.0.line", [7]), r"frames\[0\]\.line is a list, not a line number"),
    (_set("device_traces", {"0": []}), "device_traces is a dict, not a list"),
    (_set("device_traces.0", "events"), r"device_traces\[0\] is a str, not a list of events"),
    (_set(EVENT, 17), r"device_traces\[0\]\[1\] is an int, not an event"),
    (_set(EVENT + ".action", DELETE), r"device_traces\[0\]\[1\] has no 'action'"),
    (_set(EVENT + ".action", 1), r"device_traces\[0\]\[1\]\.action is an int"),
    (_set(EVENT + ".addr", "0x1000000"), r"device_traces\[0\]\[1\]\.addr is a str"),
    (_set(EVENT + ".addr", 1.5), r"device_traces\[0\]\[1\]\.addr is a float"),
    (_set(EVENT + ".size", -MB), r"device_traces\[0\]\[1\]\.size is -1048576"),
    (_set(EVENT + ".stream", None), r"device_traces\[0\]\[1\]\.stream is a NoneType"),
    (_set(EVENT + ".time_us", float("nan")), r"device_traces\[0\]\[1\]\.time_us is a float"),
    (_set(EVENT + ".time_us", 1 << 70), r"device_traces\[0\]\[1\]\.time_us is out of range"),
    (_set(EVENT + ".frames", {"name": "f"}), r"device_traces\[0\]\[1\]\.frames is a dict"),
    (_set(EVENT + ".device_free", "lots"), r"device_traces\[0\]\[1\]\.device_free is a str"),
    (lambda d: d["segments"].append(seg(0x9000000, (1 << 62) - 1)),
     r"segments\[1\]\.total_size brings the sizes .* more than 2\^62"),
    (_set("allocator_settings", ["expandable_segments"]), "allocator_settings is a list, not a dict"),
    (_set("allocator_settings.PYTORCH_CUDA_ALLOC_CONF", [1]), r"allocator_settings\.PYTORCH_CUDA_ALLOC_CONF is a list"),
    (_set("external_annotations", {"a": 1}), "external_annotations is a dict"),
    (_set("external_annotations", [{"time_us": "soon", "stage": "START"}]),
     r"external_annotations\[0\]\.time_us is a str"),
    (_set("external_annotations", [{"stage": 1}]), r"external_annotations\[0\]\.stage is an int"),
]


def _write(tmp_path, data, name="snap.pickle", protocol=4) -> str:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    return str(path)


def _one_line(e: pytest.ExceptionInfo, path) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and "fix:" in msg, msg
    return msg


@pytest.mark.parametrize("protocol", [2, 5])
@pytest.mark.parametrize("mutate, needle", WRONG_FIELDS)
def test_wrong_field_types_are_one_line_naming_the_field(tmp_path, mutate, needle, protocol):
    data = copy.deepcopy(_good())
    mutate(data)
    path = _write(tmp_path, data, protocol=protocol)
    with pytest.raises(ShardfitError, match=needle) as e:
        examine([path])
    _one_line(e, path)


def test_the_good_snapshot_and_harmless_extras_load(tmp_path):
    data = _good()
    data["device_traces"][0][1]["compile_context"] = ["nested", ["list"]]  # an extra key the doctor never reads
    data["shardfit"] = "not a dict"  # ignored as before: the record is optional
    data["unknown"] = {"deep": [[[[[]]]]]}
    (res,), _ = examine([_write(tmp_path, data)])
    assert res.replay.peak.allocated == MB and len(res.replay.snapshot.trace) == 2


def _raw(*ops: bytes) -> bytes:
    return b"\x80\x04" + b"".join(ops) + b"."


def _str(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()


# Hand-made pickles: a bomb, a lie about a length, a structure no pickler writes; (bytes, needle)
RAW = [
    (_raw(b"]", b"r" + struct.pack("<I", 0xFFFFFFF0)), "memo index 4294967280 with 0 objects memoized"),
    (_raw(b"]", b"q\x05"), "memo index 5"),
    (_raw(b"h\x03"), r"not a readable pickle \(malformed pickle \(IndexError"),
    (_raw(b"\x8d" + struct.pack("<Q", 1 << 60)), "truncated"),
    (_raw(b"X" + struct.pack("<I", 0xFFFFFFFF)), "truncated"),
    (_raw(b"\x8b" + struct.pack("<i", 0x7FFFFFFF)), "truncated"),
    (_raw(b"\x8b" + struct.pack("<i", -5)), "truncated"),
    (_raw(b"(" * 100_000), "nests 201 containers at byte 202: more than the limit of 200 containers nested while "
     "unpickling; fix: if the file is legitimate, raise the limit: export SHARDFIT_DOCTOR_MAX_DEPTH=800"),
    (_raw(b"N" + b"\x85" * 200_000 + b"}", b"(", b"N", b"\x85" * 1000, b"N", b"u"),
     "a dict key of type tuple"),
    (_raw(_str("os"), _str("system"), b"\x93"), "refused to load global 'os.system'"),
    (_raw(_str("builtins"), _str("eval"), b"\x93", _str("1"), b"\x85R"), "refused to load global 'builtins.eval'"),
    (b"\x80\x02cposix\nsystem\n.", "refused to load global 'posix.system'"),
    (_raw(_str("builtins"), _str("set"), b"\x93}\x85R"), "set built from a dict"),
    (_raw(_str("collections"), _str("OrderedDict"), b"\x93]K\x01a\x85R"), "OrderedDict built from arguments"),
    (_raw(b"](u"), "SETITEMS on a list"),
    (_raw(b"}(Ne"), "APPENDS to a dict"),
    (_raw(b"]]]]"), "stack not empty at STOP"),
    (_raw(b"b"), "opcode 0x62 at byte 2 is not one a memory snapshot uses"),
    (b"", "truncated"),
    (b"\x80\x04", "truncated"),
    (pickle.dumps({"segments": []}, protocol=0), "not one a memory snapshot uses"),
    (gzip.compress(pickle.dumps(_good()))[:-12], "corrupt gzip data"),
    (b"\x1f\x8b\x08\x00garbage", "corrupt gzip data"),
    (_raw(b"}", _str("segments"), b"]q\x00h\x00as"), r"segments\[0\] is a list"),  # a list holding itself
]


@pytest.mark.parametrize("content, needle", RAW)
def test_hand_made_pickles_are_refused_in_one_line(tmp_path, content, needle):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    t0 = time.perf_counter()
    with pytest.raises(ShardfitError, match=needle) as e:
        load_snapshot(path)
    assert time.perf_counter() - t0 < 5
    _one_line(e, path)


def test_a_deep_tuple_outside_the_schema_is_never_walked(tmp_path):
    """1,000,000 nested tuples under a key the doctor does not read: built without recursion, never hashed,
    compared or printed, freed without recursion."""
    body = b"\x80\x04}(" + _str("segments") + b"]" + _str("deep") + b"N" + b"\x85" * 1_000_000 + b"u."
    path = tmp_path / "deep.pickle"
    path.write_bytes(body)
    assert load_snapshot(path).segments == []


@pytest.mark.parametrize("env, value, make, needle", [
    ("SHARDFIT_DOCTOR_MAX_OBJECTS", "10000", lambda: pickle.dumps({"segments": [seg(i * MB, MB)
                                                                                for i in range(5000)]}),
     "builds 10,001 objects by byte .*: more than the limit of 10,000 objects built by the pickle; fix: if the "
     "file is legitimate, raise the limit: export SHARDFIT_DOCTOR_MAX_OBJECTS=40000"),
    ("SHARDFIT_DOCTOR_MAX_OBJECTS", "10000", lambda: pickle.dumps(
        {"segments": [], "device_traces": [[ev("alloc", i, 512, t=i) for i in range(5000)]]}), "10,000 objects"),
    ("SHARDFIT_DOCTOR_MAX_MIB", "1", lambda: b"\x80\x04" + b"N0" * (1 << 20) + b"N.", "the file is 2 MiB: more than "
     "the limit of 1 MiB of pickle"),
    ("SHARDFIT_DOCTOR_MAX_MIB", "zero", lambda: b"", "SHARDFIT_DOCTOR_MAX_MIB: 'zero' is not a positive whole number"),
    ("SHARDFIT_DOCTOR_MAX_DEPTH", "-1", lambda: b"", "SHARDFIT_DOCTOR_MAX_DEPTH: '-1' is not a positive"),
])
def test_size_limits_name_themselves_and_how_to_raise_them(tmp_path, monkeypatch, env, value, make, needle):
    monkeypatch.setenv(env, value)
    path = tmp_path / "big.pickle"
    path.write_bytes(make())
    with pytest.raises(ShardfitError, match=needle) as e:
        load_snapshot(path)
    assert "\n" not in str(e.value)


def test_a_sparse_file_past_the_default_limit_is_refused_unread(tmp_path):
    path = tmp_path / "huge.pickle"
    with open(path, "wb") as f:
        f.truncate(3 << 30)  # 3 GiB of holes: nothing on disk, refused from its size alone
    t0 = time.perf_counter()
    with pytest.raises(ShardfitError, match=r"the file is 3,072 MiB: more than the limit of 1,024 MiB.*"
                       r"SHARDFIT_DOCTOR_MAX_MIB=4096"):
        load_snapshot(path)
    assert time.perf_counter() - t0 < 2


def test_a_gzip_bomb_is_refused_quickly_without_inflating_it(tmp_path, monkeypatch):
    """16 GiB declared (1,024 members of 16 MiB of zeros, 16 MiB on disk): refused at a 64 MiB cap, having held
    about that much."""
    monkeypatch.setenv("SHARDFIT_DOCTOR_MAX_MIB", "64")
    member = gzip.compress(b"\x00" * (16 << 20), compresslevel=9)
    path = tmp_path / "bomb.pickle.gz"
    path.write_bytes(member * 1024)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ShardfitError, match=r"bomb\.pickle\.gz: it inflates past 64 MiB: more than the limit"):
            load_snapshot(path)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 5 and peak < 200 << 20, (elapsed, peak)


def test_a_legitimate_multi_member_gzip_loads(tmp_path):
    raw = pickle.dumps(_good())
    path = tmp_path / "two.pickle.gz"
    path.write_bytes(gzip.compress(raw[:10]) + gzip.compress(raw[10:]))  # cat a.gz b.gz
    assert load_snapshot(path).segments[0]["total_size"] == 4 * MB
