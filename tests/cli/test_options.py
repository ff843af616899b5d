"""Command-line options of every command: numbers, counts, sizes, fractions, rendezvous flags. Each mistake is one
`shardfit: error:` line naming the option, exit 2, before anything is read or started; no argv is a traceback."""

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BAD = ["nan", "NaN", "inf", "-inf", "1e999", "", " ", "abc", "0x10"]

CASES = [
    # plan: the world, node size, GPU and host memory
    *[(["plan", "--nproc", v], "--nproc: ") for v in [*BAD, "0", "-2", "1.5", "2e3", "99999999999"]],
    *[(["plan", "--gpus-per-node", v], "--gpus-per-node: ") for v in ["0", "nan", "-8"]],
    *[(["plan", "--gpu-memory", v], "--gpu-memory: ") for v in [*BAD, "0", "-80", "1e300"]],
    *[(["plan", f"--host-memory={v}"], "--host-memory: ") for v in ["nan", "inf", "0", "-1"]],
    (["plan", "--nproc"], "--nproc needs a value"),
    # doctor: a fraction in (0, 1], a size
    *[(["doctor", "x.pickle", "--memory-fraction", v], "--memory-fraction: ")
      for v in ["0", "1.0001", "2", "-0.5", "nan", "inf", "abc"]],
    *[(["doctor", "x.pickle", "--gpu-memory", v], "--gpu-memory: ") for v in ["0", "nan", "inf", "-1"]],
    (["doctor"], "shardfit doctor: the following arguments are required: snapshots"),
    (["doctor", "x.pickle", "--no-such-flag"], "shardfit doctor: unrecognized arguments: --no-such-flag"),
    # tokenize: worker processes
    *[(["tokenize", "in.txt", "--out", "o", "--workers", v], "--workers: ") for v in ["0", "-1", "2.5", "nan"]],
    (["tokenize", "in.txt"], "shardfit tokenize: the following arguments are required: --out"),
    (["tokenize", "in.txt", "--out", "o", "--format", "csv"], "argument --format: invalid choice: 'csv'"),
    (["profile"], "shardfit profile: the following arguments are required: trace"),
    # train's launcher flags
    *[(["train", f"--nproc={v}"], "--nproc: ") for v in ["inf", "nan", "0", "-1", "1e2", "2097152"]],
    (["train", "--nproc", "2", "--nnodes=nan"], "--nnodes: "),
    (["train", "--nproc", "2", "--nnodes", "2:4", "--rdzv-endpoint=n:1"], "--nnodes: '2:4' is not a whole number"),
    (["train", "--nproc", "2", "--nnodes", "2"], "--nnodes=2 needs the rendezvous address"),
    *[(["train", "--nproc", "1", "--nnodes", "2", f"--rdzv-endpoint={v}"], f"--rdzv-endpoint: {why}")
      for v, why in [("node0", "'node0' has no port"), (":29400", "':29400' has no host"), ("", "'' has no host"),
                     ("node0:", "port '' is not a number"), ("node0:0", "port '0' is not"),
                     ("node0:65536", "port '65536' is not"), ("node0:-1", "port '-1' is not"),
                     ("node0:http", "port 'http' is not"), ("[::1]", "'[::1]' has no port"),
                     ("no de:29400", "'no de' is not a host name"),
                     ("node0/x:29400", "'node0/x' is not a host name"), ("[]:29400", "'[]:29400' has no host")]],
    (["train", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint=n:1", "--node-rank=2"], "--node-rank: 2 is out"),
    (["train", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint=n:1", "--node_rank=-1"], "--node-rank: -1 is out"),
    (["train", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint=n:1", "--node-rank=x"], "--node-rank: 'x' is not"),
    (["train", "--nproc", "2", "--rdzv-backend=zmq", "--rdzv-endpoint=n:1"], "unknown rendezvous backend 'zmq'"),
    (["train", "--nproc", "2", "--rdzv-endpoint=n:1", "--rdzv-id=a b"], "--rdzv-id: 'a b' is not a job id"),
    # the command itself
    (["trian"], "unknown command 'trian' (did you mean 'train'?)"),
    (["--no-such-flag"], "unknown command '--no-such-flag'"),
]


# Each its own `python -m shardfit` (the process's exit code, and stderr at the file descriptor: a C++ log or a
# warning would be a second line): one case of each command and of the command itself. The others run in one
# subprocess through the CLI's entry point (tests/cli/session.py), each in a directory of its own: their messages are
# the same lines, the interpreter and torch started once (a process each took ~2 s: ~140 s for the table).
OWN_PROCESS = {("plan", "--nproc", "nan"), ("doctor", "x.pickle", "--memory-fraction", "0"),
               ("tokenize", "in.txt", "--out", "o", "--workers", "0"), ("train", "--nproc=inf"), ("trian",)}


@pytest.fixture(scope="module")
def in_one_session(tmp_path_factory):
    """argv -> (its subprocess.CompletedProcess, the directory it ran in), for the cases that share a driver."""
    from tests.cli.session import run_commands

    argvs = [argv for argv, _ in CASES if tuple(argv) not in OWN_PROCESS]
    dirs = [tmp_path_factory.mktemp("option") for _ in argvs]
    done = run_commands(argvs, cwd=tmp_path_factory.getbasetemp(), cwds=dirs)
    return {tuple(argv): (p, d) for argv, p, d in zip(argvs, done, dirs)}


@pytest.mark.parametrize("argv, needle", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_option_is_one_line(argv, needle, tmp_path, request):
    if tuple(argv) in OWN_PROCESS:
        p = subprocess.run([sys.executable, "-m", "shardfit", *argv], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path)
    else:
        p, tmp_path = request.getfixturevalue("in_one_session")[tuple(argv)]
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("shardfit: error: ") and needle in lines[0], lines
    assert "fix: " in lines[0]
    assert not list(tmp_path.iterdir())  # nothing written (tokenize's --out, doctor's pictures)


@pytest.mark.parametrize("endpoint, want", [
    ("node0:29400", ("node0", 29400)), ("10.0.0.1:1", ("10.0.0.1", 1)), ("[fe80::1]:29400", ("fe80::1", 29400)),
    (" n-1.x:65535 ", ("n-1.x", 65535))])
def test_good_endpoints_are_read_as_torchrun_reads_them(endpoint, want):
    from shardfit.cli.launch import check_endpoint

    assert check_endpoint(endpoint) == want


_OPTION = st.sampled_from(["--nproc", "--gpu-memory", "--host-memory", "--gpus-per-node", "--config", "--propose",
                           "--json", "--model.dim", "--data.seq_len", "--train.micro_batch", "--parallel.replicate",
                           "--model.name", "--nnodes", "--rdzv-endpoint", "--node-rank", "--rdzv-id", "--x"])
_VALUE = st.one_of(st.sampled_from(["nan", "inf", "-inf", "0", "-1", "1", "2", "8", "1e308", "", "=", "llama3-8b",
                                    "recipe:nope", "1:2", "a:1", ":", "True"]),
                   st.integers(-2**70, 2**70).map(str), st.floats(allow_nan=True).map(repr),
                   st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=8))
# (no NUL and no lone surrogate: an operating system's argv cannot hold them)
_NOISE = st.lists(st.one_of(st.tuples(_OPTION, _VALUE).map(lambda t: f"{t[0]}={t[1]}"), _OPTION, _VALUE),
                  max_size=6)
# Mostly good values with some bad ones, so that many examples get as far as a plan.
_GOOD = {"--nproc": ["1", "8", "64"], "--gpu-memory": ["80", "0.5", "1e-6"], "--host-memory": ["512", "1e-3"],
         "--gpus-per-node": ["8", "1", "3"], "--data.seq_len": ["128", "4096"], "--train.micro_batch": ["1", "4"],
         "--model.name": ["tiny", "llama3-8b"], "--parallel.offload": ["all", "none"]}
_MIXED = st.lists(st.sampled_from(sorted(_GOOD)).flatmap(
    lambda k: st.one_of(st.sampled_from(_GOOD[k]), _VALUE).map(lambda v: f"{k}={v}")), max_size=5, unique=True)
_ARGV = st.one_of(_NOISE, _MIXED)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=_ARGV)
def test_no_plan_argv_is_a_traceback(argv, capsys):
    """`shardfit plan` on any argument list: a plan (0) or one error line (2), never an exception."""
    from shardfit.cli.main import main

    rc = main(["plan", *[a for a in argv if a not in ("-h", "--help")]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0 and not err or rc == 2 and len(err) == 1 and err[0].startswith("shardfit: error: "), (rc, err)


@settings(max_examples=150, deadline=None)
@given(argv=_ARGV)
def test_no_train_launch_argv_is_a_traceback(argv):
    """train's launch options (parsed before any config is read or process started): parsed or one ShardfitError."""
    from shardfit.cli.train import parse_launch
    from shardfit.errors import ShardfitError

    try:
        nproc, launcher, _, _ = parse_launch(argv)
    except ShardfitError as e:
        assert "\n" not in str(e)
        return
    assert nproc >= 1 and all(a.startswith("--") and "=" in a for a in launcher)
