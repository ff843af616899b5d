"""`shardfit profile` on Chrome traces with the wrong contents or of pathological size (issue 22, class 5): one line
naming the file and the field, after bounded work."""

import gzip
import json
import time

import pytest

from shardfit.doctor.profile_trace import read_trace, summarize_trace
from shardfit.errors import ShardfitError


def _kernel(**kw):
    e = {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 10, "pid": 0, "tid": 7,
         "args": {"stream": 7, "correlation": 1}}
    e.update(kw)
    return {k: v for k, v in e.items() if v is not DROP}


DROP = object()


def _doc(*events) -> bytes:
    return json.dumps({"traceEvents": list(events)}).encode()


# (file bytes, the words of the one line)
CASES = [
    (json.dumps({"traceEvents": {"0": _kernel()}}).encode(), r"holds no traceEvents list \(traceEvents is a dict\)"),
    (json.dumps({"traceEvents": "[]"}).encode(), r"traceEvents is a str"),
    (json.dumps({"events": []}).encode(), r"traceEvents is a NoneType"),
    (b"17", r"holds no traceEvents list \(an int at the top\)"),
    (_doc(_kernel(), "kernel"), r"traceEvents\[1\] is a str, not an event"),
    (_doc(None), r"traceEvents\[0\] is a NoneType"),
    (_doc(_kernel(ts="100")), r"traceEvents\[0\]\.ts is a str, not a number of microseconds"),
    (_doc(_kernel(ts=True)), r"traceEvents\[0\]\.ts is a bool"),
    (_doc(_kernel(ts=None)), r"traceEvents\[0\]\.ts is missing"),
    (_doc(_kernel(dur=DROP)), r"traceEvents\[0\]\.dur is missing"),
    (_doc(_kernel(dur=-5)), r"traceEvents\[0\]\.dur is -5, outside \[0, 1e15\)"),
    (_doc(_kernel(ts=1e300)), r"traceEvents\[0\]\.ts is 1e\+300, outside"),
    (_doc(_kernel(ts=[1])), r"traceEvents\[0\]\.ts is a list"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": NaN, "dur": 1}]}', "NaN is not a number"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": Infinity}]}', "Infinity is not"),
    (b'{"traceEvents": [{"ph": "X", "ts": -Infinity}]}', "-Infinity is not"),
    (_doc(_kernel(name=DROP)), r"traceEvents\[0\] \(a complete event\) has no name"),
    (_doc(_kernel(name=["k"])), r"traceEvents\[0\]\.name is a list, not text"),
    (_doc(_kernel(cat=["kernel"])), r"traceEvents\[0\]\.cat is a list, not text"),
    (_doc(_kernel(ph=88)), r"traceEvents\[0\]\.ph is an int"),
    (_doc({"ph": "i", "cat": {"a": 1}}), r"traceEvents\[0\]\.cat is a dict"),
    (_doc(_kernel(tid=[7])), r"traceEvents\[0\]\.tid is a list, not an id"),
    (_doc(_kernel(pid={"p": 1})), r"traceEvents\[0\]\.pid is a dict"),
    (_doc(_kernel(args=[7])), r"traceEvents\[0\]\.args is a list, not a dict"),
    (_doc(_kernel(args={"stream": {"id": 7}})), r"traceEvents\[0\]\.args\.stream is a dict, not an id"),
    (_doc(_kernel(args={"correlation": 1.5})), r"traceEvents\[0\]\.args\.correlation is a float"),
    (b'{"traceEvents": [', "cannot read a Chrome trace from it: Expecting value"),
    (b"", "cannot read a Chrome trace from it"),
    (b"\xff\xfe\xfa not utf-8", "cannot read a Chrome trace from it"),
    (b'{"traceEvents": ["\xe9t\xe9"]}', "cannot read a Chrome trace from it"),
    (b"[" * 200_000 + b"]" * 200_000, "cannot read a Chrome trace from it: nested too deeply"),
    (b'{"traceEvents": [], "n": ' + b"9" * 10_000 + b"}", "cannot read a Chrome trace from it: Exceeds the limit"),
    (b"\x1f\x8bnot gzip", "cannot read a Chrome trace from it: corrupt gzip data"),
    (gzip.compress(_doc(_kernel()))[:-9], r"corrupt gzip data \(truncated\)"),
]


@pytest.mark.parametrize("content, needle", CASES)
def test_bad_traces_are_one_line_naming_the_field(tmp_path, content, needle):
    path = tmp_path / "step5_rank0.json"
    path.write_bytes(content)
    with pytest.raises(ShardfitError, match=needle) as e:
        read_trace(str(path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and "fix:" in msg, msg


def test_what_the_summary_does_not_read_is_not_refused(tmp_path):
    """Metadata events, instant events and unknown keys are left alone; a bare list of events is a trace too."""
    events = [{"ph": "M", "name": "process_name", "args": {"name": "python"}}, {"ph": "i", "ts": "later"},
              {"name": "no ph", "ts": "x"}, _kernel(), _kernel(ts=20.5, dur=4, name="flash_fwd"), {"weird": [[[]]]}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    s = summarize_trace(read_trace(str(path)))
    assert s["kernels"] == 2 and s["compute_kinds_ms"] == {"matmul": 0.01, "attention": 0.0}


@pytest.mark.parametrize("env, value, make, needle", [
    ("SHARDFIT_PROFILE_MAX_EVENTS", "100", lambda: _doc(*[_kernel(ts=i) for i in range(101)]),
     "it holds 101 events: more than the limit of 100 trace events; fix: if the file is legitimate, raise the "
     "limit: export SHARDFIT_PROFILE_MAX_EVENTS=400"),
    ("SHARDFIT_PROFILE_MAX_MIB", "1", lambda: _doc(*[{"ph": "M", "pad": "x" * 1000}] * 2000),
     "the file is 2 MiB: more than the limit of 1 MiB of JSON"),
    ("SHARDFIT_PROFILE_MAX_MIB", "1.5", lambda: _doc(), "SHARDFIT_PROFILE_MAX_MIB: '1.5' is not a positive whole"),
])
def test_size_limits_name_themselves(tmp_path, monkeypatch, env, value, make, needle):
    monkeypatch.setenv(env, value)
    path = tmp_path / "t.json"
    path.write_bytes(make())
    with pytest.raises(ShardfitError, match=needle):
        read_trace(str(path))


def test_a_gzip_bomb_is_refused_quickly(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFIT_PROFILE_MAX_MIB", "32")
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b" " * (16 << 20), compresslevel=9) * 256)  # 4 GiB declared, 4 MiB on disk
    t0 = time.perf_counter()
    with pytest.raises(ShardfitError, match="it inflates past 32 MiB: more than the limit of 32 MiB"):
        read_trace(str(path))
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("make, needle", [(lambda p: p, "Chrome trace file not found"),
                                          (lambda p: p.mkdir() or p, "is a directory")])
def test_missing_file_or_a_directory(tmp_path, make, needle):
    path = make(tmp_path / "t.json")
    with pytest.raises(ShardfitError, match=needle):
        read_trace(str(path))
