"""Bad files as a user meets them: `python -m shardfit doctor|profile|plan` exits 2 with one `shardfit: error:` line
and no traceback; and hypothesis over snapshot bytes and trace JSON: never an exception other than ShardfitError,
never unbounded work (issue 22, class 5)."""

import gzip
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardfit.doctor import examine
from shardfit.doctor.profile_trace import read_trace, summarize_trace
from shardfit.errors import ShardfitError
from tests.doctor.conftest import FIXTURES, MB, ev, seg

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shardfit", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC, **(env or {})})


def _cli_case(case: str, tmp: Path) -> tuple[list[str], str, dict]:
    if case == "segments a dict":
        (tmp / "a.pickle").write_bytes(pickle.dumps({"segments": {"0": 1}}))
        return ["doctor", str(tmp / "a.pickle")], "a.pickle: segments is a dict, not a list", {}
    if case == "event addr a string":
        (tmp / "b.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc",
                                                                                          "addr": "0x10"}]]}))
        return ["doctor", str(tmp / "b.pickle")], r"device_traces[0][0].addr is a str", {}
    if case == "gzip bomb":
        (tmp / "c.pickle.gz").write_bytes(gzip.compress(b"\0" * (8 << 20)) * 64)
        return ["doctor", str(tmp / "c.pickle.gz")], "inflates past 4 MiB", {"SHARDFIT_DOCTOR_MAX_MIB": "4"}
    if case == "memo bomb":
        (tmp / "d.pickle").write_bytes(b"\x80\x04]r\xf0\xff\xff\xff.")
        return ["doctor", str(tmp / "d.pickle")], "memo index 4294967280", {}
    if case == "trace events not a list":
        (tmp / "t.json").write_text('{"traceEvents": {"a": 1}}')
        return ["profile", str(tmp / "t.json")], "traceEvents is a dict", {}
    if case == "trace ts NaN":
        (tmp / "t.json").write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": NaN}]}')
        return ["profile", str(tmp / "t.json")], "NaN is not a number", {}
    if case == "trace not UTF-8":
        (tmp / "t.json").write_bytes(b'{"traceEvents": ["\xff"]}')
        return ["profile", str(tmp / "t.json")], "cannot read a Chrome trace", {}
    if case == "trace nested deep":
        (tmp / "t.json").write_bytes(b"[" * 100_000)
        return ["profile", str(tmp / "t.json")], "nested too deeply", {}
    if case == "plan of absurd sizes":
        return ["plan", "--nproc=1", "--gpu-memory=80", "--train.micro_batch=1099511627776",
                "--train.global_batch=1099511627776"], "data.seq_len: the tokens of a micro-batch", {}
    if case == "limit variable not a number":
        (tmp / "e.pickle").write_bytes(pickle.dumps({"segments": []}))
        return ["doctor", str(tmp / "e.pickle")], "SHARDFIT_DOCTOR_MAX_OBJECTS: 'many'", {
            "SHARDFIT_DOCTOR_MAX_OBJECTS": "many"}
    raise AssertionError(case)


CLI_CASES = ["segments a dict", "event addr a string", "gzip bomb", "memo bomb", "trace events not a list",
             "trace ts NaN", "trace not UTF-8", "trace nested deep", "plan of absurd sizes",
             "limit variable not a number"]
# Each its own `python -m shardfit` (the exit code, stderr at the file descriptor): the cases with a limit variable
# of their own, the deepest nesting (the interpreter's recursion as a fresh process has it), and the plan. The others
# run in one subprocess through the CLI's entry point (tests/cli/session.py; ~2 s a process less each).
OWN_PROCESS = {"gzip bomb", "limit variable not a number", "trace nested deep", "plan of absurd sizes"}
REFUSED_PLAN = ["plan", "--nproc=3", "--gpu-memory=80", "--parallel.sequence_parallel=2"]


@pytest.fixture(scope="module")
def in_one_session(tmp_path_factory):
    """case -> (its subprocess.CompletedProcess, needle), for the cases that share a driver process; "refused plan":
    test_plan_prints_a_refused_layout_as_refused's command."""
    from tests.cli.session import run_commands

    names = [c for c in CLI_CASES if c not in OWN_PROCESS]
    made = {c: _cli_case(c, tmp_path_factory.mktemp("case")) for c in names}
    assert not any(env for _, _, env in made.values())  # the driver's environment is the test's
    done = run_commands([made[c][0] for c in names] + [REFUSED_PLAN], cwd=tmp_path_factory.getbasetemp())
    return {**{c: (p, made[c][1]) for c, p in zip(names, done)}, "refused plan": (done[-1], None)}


@pytest.mark.parametrize("case", CLI_CASES)
def test_the_cli_says_one_line_and_exits_2(tmp_path, case, request):
    if case in OWN_PROCESS:
        args, needle, env = _cli_case(case, tmp_path)
        r = _run(*args, env=env)
    else:
        r, needle = request.getfixturevalue("in_one_session")[case]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("shardfit: error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_plan_prints_a_refused_layout_as_refused(in_one_session):
    r, _ = in_one_session["refused plan"]
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "REFUSED by shardfit train: parallel.sequence_parallel: parallel.sequence_parallel=2 does not divide the " \
           "world size 3" in r.stdout and "as configured: fits" not in r.stdout


# ---- property tests: any bytes the doctor is given end in a report or in one ShardfitError line

def _small_real() -> list[bytes]:
    files = ["record_stream_pending.pickle", "fsdp1_meta_nosync_rank0.pickle"]
    return [(FIXTURES / f).read_bytes() for f in files if (FIXTURES / f).is_file()]


def _synthetic() -> bytes:
    frames = [{"name": "forward", "filename": "torch/nn/modules/linear.py", "line": 7}]
    trace = [ev("segment_alloc", 0x1000000, 4 * MB), ev("alloc", 0x1000000, MB, frames=frames, t=1),
             ev("free_requested", 0x1000000, MB, t=2), ev("free_completed", 0x1000000, MB, t=3),
             ev("oom", 0, 8 * MB, t=4, device_free=MB)]
    return pickle.dumps({"segments": [seg(0x1000000, 4 * MB, [(0, MB, "active_pending_free", frames)])],
                         "device_traces": [trace], "allocator_settings": {"expandable_segments": False},
                         "external_annotations": [{"time_us": 1, "stage": "START", "name": "step"}]})


SEEDS = _small_real() + [_synthetic()]


def _doctor_bytes(tmp: Path, content: bytes) -> None:
    path = tmp / "rank0.pickle"
    path.write_bytes(content)
    t0 = time.perf_counter()
    try:
        examine([str(path)])
    except ShardfitError as e:
        assert "\n" not in str(e) and str(e).startswith(str(path))
    assert time.perf_counter() - t0 < 10


@st.composite
def _mutated(draw):
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[i] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[i:]
        elif kind == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[i:i + draw(st.integers(1, 16))]
    return bytes(data)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(content=_mutated(), compress=st.booleans())
def test_mutated_snapshot_bytes_never_escape_as_a_traceback(tmp_path_factory, content, compress):
    _doctor_bytes(tmp_path_factory.mktemp("m"), gzip.compress(content) if compress else content)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True),
                     st.text(max_size=8), st.sampled_from(["alloc", "free_requested", "free_completed", "oom",
                                                           "segment_alloc", "active_allocated", "size", "addr"]))
_keys = st.sampled_from(["segments", "device_traces", "blocks", "frames", "address", "total_size", "size", "addr",
                         "action", "stream", "state", "time_us", "device", "name", "filename", "line",
                         "allocator_settings", "external_annotations", "requested_size", "device_free", "x"])
_plain = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=5), st.tuples(inner, inner),
                                                        st.dictionaries(_keys, inner, max_size=6)), max_leaves=40)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(_keys, _plain, max_size=5), protocol=st.integers(2, 5))
def test_random_plain_pickles_never_escape_as_a_traceback(tmp_path_factory, body, protocol):
    _doctor_bytes(tmp_path_factory.mktemp("p"), pickle.dumps(body, protocol=protocol))


_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(1 << 64), 1 << 64), st.floats(),
                               st.text(max_size=6), st.sampled_from(["X", "kernel", "cpu_op", "cuda_runtime"])),
                     lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(
                         st.sampled_from(["ph", "cat", "name", "ts", "dur", "args", "stream", "correlation", "pid",
                                          "tid", "traceEvents"]), inner, max_size=6)), max_leaves=30)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=_json, cut=st.integers(0, 64))
def test_random_trace_json_never_escapes_as_a_traceback(tmp_path_factory, doc, cut):
    path = tmp_path_factory.mktemp("t") / "t.json"
    text = json.dumps(doc if not isinstance(doc, list) else {"traceEvents": doc}).encode()
    path.write_bytes(text[:len(text) - cut] if cut % 3 == 0 else text)
    try:
        summarize_trace(read_trace(str(path)))
    except ShardfitError as e:
        assert "\n" not in str(e)
