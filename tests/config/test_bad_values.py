"""Bad config values (issue 22, classes 3 and 5): every key's range, non-finite floats, the rules that tie keys
together, and a property test that any value for any key either loads or raises ShardfitError."""

import dataclasses
import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardfit.config import Config, load_config
from shardfit.config.loader import range_text
from shardfit.errors import ShardfitError

# (overrides, the key the line must name, what it must say). More than the issue names: every range kind (> 0,
# >= 0, [0, 1), (0, 1], ceilings), non-finite floats in every float section, ints beyond 64 bits, and each rule.
BAD = [
    (["--train.lr=nan"], "train.lr", "nan is not a finite number; fix: give a finite value in (0, 1]"),
    (["--train.lr=inf"], "train.lr", "inf is not a finite number"),
    (["--train.lr=-3e-4"], "train.lr", "-0.0003 is out of range; fix: give a value in (0, 1]"),
    (["--train.lr=30"], "train.lr", "30.0 is out of range"),
    (["--train.lr=1e400"], "train.lr", "inf is not a finite number"),  # overflows to inf when parsed
    (["--train.beta1=1"], "train.beta1", "1.0 is out of range; fix: give a value in [0, 1)"),
    (["--train.beta2=1.0"], "train.beta2", "give a value in [0, 1)"),
    (["--train.beta2=-0.1"], "train.beta2", "-0.1 is out of range"),
    (["--train.beta1=nan"], "train.beta1", "nan is not a finite number"),
    (["--train.eps=0"], "train.eps", "0.0 is out of range; fix: give a value in (0, 1)"),
    (["--train.eps=-inf"], "train.eps", "-inf is not a finite number"),
    (["--train.weight_decay=-0.01"], "train.weight_decay", "fix: give a value >= 0"),
    (["--train.weight_decay=inf"], "train.weight_decay", "inf is not a finite number"),
    (["--train.grad_clip=-1"], "train.grad_clip", "fix: give a value >= 0"),
    (["--train.grad_clip=nan"], "train.grad_clip", "nan is not a finite number"),
    (["--train.min_lr_ratio=1.5"], "train.min_lr_ratio", "give a value in [0, 1]"),
    (["--train.warmup_steps=-1"], "train.warmup_steps", "-1 is out of range"),
    (["--train.watchdog_s=nan"], "train.watchdog_s", "nan is not a finite number"),
    (["--train.seed=-1"], "train.seed", "-1 is out of range"),
    (["--train.steps=0"], "train.steps", "0 is out of range; fix: give a value > 0"),
    (["--train.steps=99999999999999999999"], "train.steps", "does not fit a 64-bit integer"),
    (["--train.global_batch=0"], "train.global_batch", "0 is out of range"),
    (["--data.seq_len=1"], "data.seq_len", "1 is out of range; fix: give a value >= 2"),
    (["--data.seed=-5"], "data.seed", "-5 is out of range"),
    (["--data.val_fraction=1"], "data.val_fraction", "give a value in [0, 1)"),
    (["--data.val_fraction=nan"], "data.val_fraction", "nan is not a finite number"),
    (["--model.vocab_size=0"], "model.vocab_size", "0 is out of range"),
    (["--model.n_layers=100000000"], "model.n_layers", "give a value in (0, 1024]"),
    (["--model.dim=4611686018427387904"], "model.dim", "is out of range"),  # 2**62 would overflow the count
    (["--model.norm_eps=0"], "model.norm_eps", "give a value in (0, 1)"),
    (["--model.rope_theta=nan"], "model.rope_theta", "nan is not a finite number"),
    (["--model.rope_factor=0.5"], "model.rope_factor", "give a value >= 1"),
    (["--model.init_std=inf"], "model.init_std", "inf is not a finite number"),
    (["--model.router_aux_coef=-1"], "model.router_aux_coef", "give a value >= 0"),
    (["--memory.max_fraction=1.5"], "memory.max_fraction", "give a value in [0, 1]"),
    (["--memory.warn_growth_mib=nan"], "memory.warn_growth_mib", "nan is not a finite number"),
    (["--logging.peak_tflops=inf"], "logging.peak_tflops", "inf is not a finite number"),
    (["--logging.log_every=0"], "logging.log_every", "0 is out of range"),
    (["--compute.loss_chunk=0"], "compute.loss_chunk", "0 is out of range"),
    (["--checkpoint.keep=-1"], "checkpoint.keep", "-1 is out of range"),
    # rules over several keys
    (["--model.dim=254", "--model.n_heads=2", "--model.n_kv_heads=2"], "model.head_dim",
     "the head dimension 127 is odd"),
    (["--model.head_dim=33"], "model.head_dim", "the head dimension 33 is odd"),
    (["--model.n_kv_heads=3"], "model.n_kv_heads", "n_heads=8 is not a multiple of n_kv_heads=3"),
    (["--model.n_kv_heads=16"], "model.n_kv_heads", "not a multiple of n_kv_heads=16"),
    (["--model.dim=100", "--model.n_heads=8"], "model.n_heads", "dim=100 is not divisible by n_heads=8"),
    (["--model.n_experts=4", "--model.experts_per_token=5", "--model.moe_ffn_dim=8"], "model.experts_per_token",
     "0 < experts_per_token <= n_experts=4"),
    (["--model.rope_scaling=llama3", "--model.rope_low_freq_factor=4", "--model.rope_high_freq_factor=1"],
     "model.rope_high_freq_factor", "needs high_freq_factor > low_freq_factor"),
    (["--model.name=qwen3-30b-a3b", "--model.n_layers=4", "--model.dense_layers=0,x"], "model.dense_layers",
     "'x' is not a layer index in 0..3"),
    (["--model.name=qwen3-30b-a3b", "--model.n_layers=4", "--model.dense_layers=4"], "model.dense_layers",
     "'4' is not a layer index"),
    (["--logging.profile_step=200", "--train.steps=10"], "logging.profile_step", "after the last step 10"),
    (["--memory.snapshot_steps=1-100000000000"], "memory.snapshot_steps", "not a range of steps within 1..150"),
    (["--memory.snapshot_steps=4-2"], "memory.snapshot_steps", "not a range of steps"),
    (["--memory.snapshot_steps=three"], "memory.snapshot_steps", "cannot read 'three'"),
    (["--data.path=a.jsonl", "--data.val_path=a.jsonl"], "data.val_path", "is the same as data.path"),
    (["--data.val_path=v.jsonl", "--data.val_fraction=0.1"], "data.val_fraction", "set together with data.val_path"),
    (["--data.seq_len=4096"], "data.seq_len", "above the model's limit max_seq_len=1024"),
    # what preference training would ignore (config/preference_rules.py): never a silent approximation
    (["--preference.objective=dpo", "--data.mode=pretrain"], "data.mode",
     "pretrain packs documents, but preference.objective=dpo trains on preference records"),
    (["--preference.objective=kto", "--data.path=p.jsonl", "--data.format=messages"], "data.format",
     "messages is a fine-tuning layout, but preference.objective=kto detects each preference record's own layout "
     "({prompt?, chosen, rejected}"),
    (["--preference.objective=orpo", "--data.pack=false"], "data.pack",
     "false pads one example a row, but preference.objective=orpo always packs"),
    (["--preference.objective=ipo", "--preference.label_smoothing=0.1"], "preference.label_smoothing",
     "0.1 smooths the dpo and simpo losses only, not preference.objective=ipo; fix: drop"),
    (["--preference.label_smoothing=0.1"], "preference.label_smoothing", "not preference.objective=none"),
]


@pytest.mark.parametrize("args, key, needle", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_value_is_one_line_naming_key_value_and_fix(args, key, needle):
    with pytest.raises(ShardfitError) as e:
        load_config(None, args)
    msg = str(e.value)
    assert needle in msg, msg
    assert key in msg and "fix: " in msg and "\n" not in msg


@pytest.mark.parametrize("toml, needle", [
    ("[train]\nlr = nan\n", "train.lr: nan is not a finite number"),
    ("[train]\nbeta2 = inf\n", "train.beta2: inf is not a finite number"),
    ("[train]\nlr = 1" + "0" * 400 + "\n", "is too large for a float"),  # TOML ints are unbounded in tomllib
    ("[train]\nsteps = 9223372036854775808\n", "does not fit a 64-bit integer"),
    ("[model]\nn_heads = true\n", "expected a whole number, got bool True"),
    ("[recipe]\nneeds = 5\n[train]\nsteps = 3\n", None),  # a malformed [recipe] table is not a training key
])
def test_bad_value_in_a_toml_file(tmp_path, toml, needle):
    f = tmp_path / "run.toml"
    f.write_text(toml)
    if needle is None:
        assert load_config(f).train.steps == 3
        return
    with pytest.raises(ShardfitError, match=needle.replace("(", r"\(")):
        load_config(f)


@pytest.mark.parametrize("content, needle", [
    (None, "is a directory, not a config file"),
    (b"[train]\nlr = \"\xff\"\n", "cannot read the config file .*invalid start byte"),
    (b"[train]\nlr = 1\n[train]\n", "malformed TOML"),
])
def test_unreadable_config_file_is_one_line(tmp_path, content, needle):
    path = tmp_path
    if content is not None:
        path = tmp_path / "x.toml"
        path.write_bytes(content)
    with pytest.raises(ShardfitError, match=needle):
        load_config(path)


def test_every_range_in_the_schema_reads_as_a_fix():
    """Each bounded key's range text is what the error's fix says, and the default lies inside it."""
    cfg = Config()
    bounded = 0
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            text = range_text(f.metadata)
            if text:
                bounded += 1
                assert text.startswith((">", "<", "in [", "in ("))
    assert bounded >= 45
    load_config()  # every default is inside its own range


def test_hf_config_json_with_a_wrong_type_is_one_line(tmp_path):
    hf = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "max_position_embeddings": 128, "rms_norm_eps": "tiny"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ShardfitError, match=r"config.json model.norm_eps: expected a number, got str 'tiny'"):
        load_config(None, [f"--model.path={tmp_path}"])
    hf["rms_norm_eps"], hf["rope_theta"] = 1e-5, float("inf")
    (tmp_path / "config.json").write_text(json.dumps(hf).replace("Infinity", "1e999"))
    with pytest.raises(ShardfitError, match=r"model.rope_theta: inf is not a finite number"):
        load_config(None, [f"--model.path={tmp_path}"])


CLI_CASES = [(["--train.lr=nan", "--train.steps=1"], "train.lr: nan is not a finite number"),
             (["--model.head_dim=33", "--train.steps=1"], "model.head_dim: the head dimension 33 is odd"),
             (["--preference.objective=ipo", "--preference.label_smoothing=0.1", "--train.steps=1"],
              "preference.label_smoothing: 0.1 smooths the dpo and simpo losses only")]


@pytest.fixture(scope="module")
def in_one_session(tmp_path_factory):
    """Both cases through the CLI's entry point in one subprocess (tests/cli/session.py: the interpreter and torch
    started once; `shardfit train`'s bad input as a process of its own is tests/cli/test_bad_input.py's)."""
    from tests.cli.session import run_commands

    done = run_commands([["train", *args] for args, _ in CLI_CASES], cwd=tmp_path_factory.mktemp("bad_values"))
    return {tuple(args): p for (args, _), p in zip(CLI_CASES, done)}


@pytest.mark.parametrize("args, needle", CLI_CASES)
def test_cli_prints_one_error_line_and_exits_2(args, needle, in_one_session):
    r = in_one_session[tuple(args)]
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardfit: error: ") and needle in lines[0], lines
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------------------------
# Property: any value for any key loads or raises ShardfitError: never another exception, never a hang.

KEYS = [(s, f.name) for s, sec in vars(Config()).items() for f in dataclasses.fields(sec)
        if f.name not in ("path", "val_path", "tokenizer", "run_dir", "dir", "export_hf")]  # paths: see below
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=-2.0, max_value=2.0),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70), st.integers(min_value=-3, max_value=300),
    st.booleans(), st.text(max_size=12),
    st.sampled_from(["", "auto", "none", "1e400", "-0", "0x10", "1_000", "llama3", "3,4", "1-2", "nan"]),
    st.lists(st.integers(min_value=0, max_value=3), max_size=3),
)
# Path keys get paths, not arbitrary text: "/" as data.path would send the loader's data-mode probe over the whole
# file system, which is what the user asked for, not a hang to find here.
PATH_KEYS = [("data", "path"), ("data", "val_path"), ("data", "tokenizer"), ("model", "path"),
             ("logging", "run_dir"), ("checkpoint", "dir"), ("checkpoint", "export_hf")]
PATHS = st.sampled_from(["", "missing/x.jsonl", "tests/config", "tests/config/*.nothing", "pyproject.toml",
                         "pyproject.toml/x", "src/**/*.txt", "byte", 5, 1.5, True])
PAIRS = st.lists(st.one_of(st.tuples(st.sampled_from(KEYS), VALUES), st.tuples(st.sampled_from(PATH_KEYS), PATHS)),
                 min_size=1, max_size=3)


def _cli(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _toml(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _loads_or_refuses(path, overrides) -> None:
    try:
        load_config(path, overrides)
    except ShardfitError as e:
        assert "\n" not in str(e)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PAIRS)
def test_any_override_loads_or_raises_shardfit_error(pairs):
    _loads_or_refuses(None, [f"--{s}.{k}={_cli(v)}" for (s, k), v in pairs])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PAIRS)
def test_any_toml_value_loads_or_raises_shardfit_error(pairs):
    tables: dict[str, list[str]] = {}
    for (s, k), v in pairs:
        tables.setdefault(s, []).append(f"{k} = {_toml(v)}")
    text = "".join(f"[{s}]\n" + "\n".join(dict.fromkeys(lines)) + "\n" for s, lines in tables.items())
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "run.toml"
        f.write_text(text, encoding="utf-8", errors="surrogatepass")
        _loads_or_refuses(f, None)
