"""Every kind of bad input: exit code 2, one line naming what and where, and nothing half-written left behind."""

import json
import pickle
import subprocess
import sys

import pytest

from tests.cli.test_cli import TINY


def _hf_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    path = tmp_path / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _setup(case, tmp_path):
    """(shardfit arguments, text the error line must contain)."""
    if case == "malformed toml":
        (tmp_path / "c.toml").write_text("[train\n")
        return ["train", f"--config={tmp_path}/c.toml"], "c.toml: malformed TOML"
    if case == "unknown key":
        return ["train", "--train.stpes=3"], "did you mean 'train.steps'"
    if case == "wrong type":
        return ["train", "--train.lr=fast"], "train.lr: 'fast' is not a number"
    if case == "out of range":
        return ["train", "--train.micro_batch=-1"], "train.micro_batch: -1 is out of range"
    if case == "missing model dir":
        return ["train", f"--model.path={tmp_path}/nope"], f"{tmp_path}/nope: model directory not found"
    if case == "unreadable model dir":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text("{not json")
        return ["train", f"--model.path={tmp_path}/m"], "config.json: invalid JSON"
    if case in ("truncated safetensors", "shape mismatch"):
        path = _hf_dir(tmp_path)
        if case == "truncated safetensors":
            f = path / "model.safetensors"
            f.write_bytes(f.read_bytes()[:1000])
            return ["train", f"--model.path={path}"], "model.safetensors: corrupt or truncated safetensors file"
        cfg = json.loads((path / "config.json").read_text())
        cfg["intermediate_size"] = 48
        (path / "config.json").write_text(json.dumps(cfg))
        return ["train", f"--model.path={path}"], "the model expects [48, 32]"
    if case == "empty dataset":
        (tmp_path / "empty.jsonl").write_text("\n")
        return ["train", f"--data.path={tmp_path}/empty.jsonl"], "empty.jsonl: the dataset holds no text"
    if case == "undecodable document":
        (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\xfe\n")
        return ["train", f"--data.path={tmp_path}/bad.txt"], "bad.txt:2: line is not valid UTF-8"
    if case == "sequence above model limit":
        return ["train", "--data.seq_len=4096"], "data.seq_len: seq_len=4096 is above the model's limit"
    if case == "world size does not divide batch":
        return ["train", "--nproc=2", "--train.global_batch=6", "--train.micro_batch=2"], \
            "not a multiple of micro_batch x world size = 2 x 2"
    if case == "replicas that do not divide the world":  # found by the launcher before any process starts
        return ["train", "--nproc=2", "--parallel.replicate=3"], "parallel.replicate=3 does not divide the world size 2"
    if case == "zero processes":
        return ["train", "--nproc=0"], "--nproc: 0 is out of range; fix: give 1 or more processes"
    if case == "recipe without weights":
        return ["train", "--config=recipe:llama3-8b-sft-8gpu"], "recipe 'llama3-8b-sft-8gpu' needs model.path"
    if case == "unknown recipe":
        return ["train", "--config=recipe:llama-8b"], "--config: unknown recipe 'llama-8b'"
    if case == "generate without a checkpoint":
        return ["generate", "--checkpoint", f"{tmp_path}/nope", "--prompt", "hi"], "nope: checkpoint not found"
    if case == "not a trace":
        (tmp_path / "t.json.gz").write_bytes(b"\x1f\x8bnot gzip")
        return ["profile", f"{tmp_path}/t.json.gz"], "cannot read a Chrome trace from"
    if case == "trace without kernels":  # a CPU run's trace
        (tmp_path / "t.json").write_text('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", '
                                         '"ts": 0, "dur": 5}]}')
        return ["profile", f"{tmp_path}/t.json"], "t.json holds no GPU kernels"
    if case == "not a snapshot":
        (tmp_path / "x.pickle").write_bytes(pickle.dumps({"hello": 1}))
        return ["doctor", f"{tmp_path}/x.pickle"], "x.pickle: not a CUDA memory snapshot"
    raise AssertionError(case)


# The checkpoint cases' messages are also checked in-process (tests/weights/test_hf_checkpoints.py:
# test_bad_checkpoints_name_file_and_tensor): as subprocesses they run with the slow tests.
CASES = ["malformed toml", "unknown key", "wrong type", "out of range", "missing model dir", "unreadable model dir",
         pytest.param("truncated safetensors", marks=pytest.mark.slow),
         pytest.param("shape mismatch", marks=pytest.mark.slow), "empty dataset", "undecodable document",
         "sequence above model limit", "world size does not divide batch", "replicas that do not divide the world",
         "not a snapshot", "zero processes", "recipe without weights", "unknown recipe",
         "generate without a checkpoint", "not a trace", "trace without kernels"]
# Each its own `python -m shardfit` (the process's exit code, and stderr at the file descriptor: a C++ log or a
# warning would be a second line): one case past the process group and the data, one through the launcher's checks,
# one of another command. The others run in one subprocess through the CLI's entry point (tests/cli/session.py):
# their messages are the same lines, the interpreter and torch started once.
OWN_PROCESS = {"empty dataset", "world size does not divide batch", "generate without a checkpoint"}


def _command(case, tmp_path):
    """(argv after `shardfit`, needle, run directory, export directory) of a case set up under tmp_path."""
    args, needle = _setup(case, tmp_path)
    run_dir = tmp_path / "run"
    extra = [*TINY, f"--logging.run_dir={run_dir}", f"--checkpoint.export_hf={tmp_path}/export"] \
        if args[0] == "train" and "--model.path" not in " ".join(args) else (
            ["--train.device=cpu", "--data.seq_len=32", f"--logging.run_dir={run_dir}"] if args[0] == "train" else [])
    return [args[0], *extra, *args[1:]], needle, run_dir, tmp_path / "export"  # the case's own arguments win


@pytest.fixture(scope="module")
def in_one_session(tmp_path_factory):
    """case -> (its subprocess.CompletedProcess, needle, run directory, export directory), for the cases that share a
    driver process."""
    from tests.cli.session import run_commands

    names = [c for c in CASES if isinstance(c, str) and c not in OWN_PROCESS]
    made = {c: _command(c, tmp_path_factory.mktemp("case")) for c in names}
    done = run_commands([made[c][0] for c in names], cwd=tmp_path_factory.getbasetemp())
    return {c: (p, *made[c][1:]) for c, p in zip(names, done)}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_table(tmp_path, case, request):
    if case in OWN_PROCESS or request.node.get_closest_marker("slow"):
        argv, needle, run_dir, export = _command(case, tmp_path)
        p = subprocess.run([sys.executable, "-m", "shardfit", *argv], capture_output=True, text=True, timeout=120)
    else:
        p, needle, run_dir, export = request.getfixturevalue("in_one_session")[case]
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("shardfit: error: ") and needle in lines[0], lines
    assert "fix:" in lines[0] or case in ("unreadable model dir",)
    assert not run_dir.exists() and not export.exists()  # nothing half-written
