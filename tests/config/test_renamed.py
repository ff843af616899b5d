"""config/renamed.py: the [compute] keys' old [parallel] spellings load as the new keys, with one notice line per
key per run; both spellings of one key in one source is an error naming both."""

import dataclasses

import pytest

from shardfit.config import ComputeConfig, config_to_toml, load_config, renamed
from shardfit.errors import ShardfitError


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test as a new run: nothing announced yet, not a rank of a launch."""
    monkeypatch.setattr(renamed, "_announced", set())
    for var in ("RANK", "SHARDFIT_LAUNCHER_PID"):
        monkeypatch.delenv(var, raising=False)


def _other_value(f: dataclasses.Field) -> str:
    """A value of the field other than its default, as the command line writes it."""
    default = f.default
    if f.metadata.get("choices"):
        return next(c for c in f.metadata["choices"] if c != default)
    if isinstance(default, bool):
        return str(not default).lower()
    return str(default + 1)


COMPUTE = [(f.name, _other_value(f)) for f in dataclasses.fields(ComputeConfig) if f.name not in renamed.NEW_IN_COMPUTE]


def test_every_compute_key_has_its_old_spelling():
    assert {f"parallel.{k}": f"compute.{k}" for k, _ in COMPUTE} == renamed.RENAMED
    assert len(COMPUTE) == 13  # the keys of issue 26's split: a key moved later needs its own entry here
    assert "parallel.ac_blocks" not in renamed.RENAMED  # added to [compute] since: no old spelling


@pytest.mark.parametrize("key, value", COMPUTE)
def test_old_spelling_on_the_command_line_is_the_new_key_with_one_notice(key, value, capsys):
    full = ["--compute.activation_checkpoint=full"] if key == "ac_every" else []  # it picks blocks of full AC
    old = load_config(None, [f"--parallel.{key}={value}", *full])
    line = capsys.readouterr().err
    assert line == (f"shardfit: parallel.{key} is now compute.{key}; the old spelling is accepted until "
                    f"{renamed.UNTIL}\n")
    new = load_config(None, [f"--compute.{key}", value, *full])
    assert old == new and str(getattr(new.compute, key)).lower() == value
    assert capsys.readouterr().err == ""  # the new spelling says nothing


def test_old_spellings_in_a_toml_file_and_in_a_saved_run_config(tmp_path, capsys):
    f = tmp_path / "old.toml"
    f.write_text('[parallel]\ncompile = true\nfp8 = "rowwise"\nsequence_parallel = 1\n')
    assert load_config(f) == load_config(None, ["--compute.compile=true", "--compute.fp8=rowwise"])
    err = capsys.readouterr().err.splitlines()
    assert [x.split(" is now ")[0] for x in err] == ["shardfit: parallel.compile", "shardfit: parallel.fp8"]
    # a run's config.toml as 0.1 wrote it: every [compute] key under [parallel]
    cfg = load_config(None, ["--compute.activation_checkpoint=full", "--compute.loss_chunk=512"])
    text = config_to_toml(cfg)
    head, compute = text.split("[compute]\n")
    compute, rest = compute.split("\n\n", 1)
    # keys added to [compute] since 0.1 were not in its files
    compute = "\n".join(x for x in compute.splitlines() if x.split(" = ")[0] not in renamed.NEW_IN_COMPUTE)
    saved = tmp_path / "config.toml"
    saved.write_text(head.replace("[parallel]\n", "[parallel]\n" + compute + "\n") + rest)
    assert "[compute]" not in saved.read_text() and load_config(saved) == cfg
    # generate reads the model and data of the same file
    from shardfit.weights.local import checkpoint_config

    assert checkpoint_config(tmp_path).model == cfg.model


def test_one_notice_per_run(capsys, monkeypatch):
    load_config(None, ["--parallel.compile=true"])
    load_config(None, ["--parallel.compile=true", "--parallel.fp8=rowwise"])  # the same process loads again
    assert [x.split(" is now ")[0] for x in capsys.readouterr().err.splitlines()] == [
        "shardfit: parallel.compile", "shardfit: parallel.fp8"]
    # the ranks of a launch: the launcher (or rank 0 of the user's torchrun) has said it
    for var, value in (("SHARDFIT_LAUNCHER_PID", "123"), ("RANK", "1")):
        monkeypatch.setattr(renamed, "_announced", set())
        with monkeypatch.context() as m:
            m.setenv(var, value)
            assert load_config(None, ["--parallel.compile=true"]).compute.compile
        assert capsys.readouterr().err == ""


def test_a_bad_config_is_still_one_line(capsys):
    with pytest.raises(ShardfitError, match=r"--parallel.compile compute.compile: 'maybe' is not true or false"):
        load_config(None, ["--parallel.compile=maybe"])
    with pytest.raises(ShardfitError, match=r"train.steps: 0 is out of range"):
        load_config(None, ["--parallel.compile=true", "--train.steps=0"])
    assert capsys.readouterr().err == ""  # no notice before an error


@pytest.mark.parametrize("source", ["command line", "file"])
def test_both_spellings_in_one_source_is_an_error_naming_both(source, tmp_path):
    if source == "file":
        f = tmp_path / "both.toml"
        f.write_text("[compute]\ncompile = false\n[parallel]\ncompile = true\n")
        args: tuple = (f, [])
    else:
        args = (None, ["--compute.compile=false", "--parallel.compile", "true"])
    with pytest.raises(ShardfitError) as e:
        load_config(*args)
    where = str(tmp_path / "both.toml") if source == "file" else "command line"
    assert str(e.value) == (f"{where}: parallel.compile and compute.compile are both given (parallel.compile is the "
                            "old spelling of compute.compile); fix: keep compute.compile only")


def test_the_command_line_overrides_an_old_file(tmp_path):
    """Different sources keep their precedence: an old file and the new spelling on the command line is no error."""
    f = tmp_path / "old.toml"
    f.write_text("[parallel]\ncompile = true\n")
    assert load_config(f, ["--compute.compile=false"]).compute.compile is False
    assert load_config(f, ["--parallel.compile=false"]).compute.compile is False


def test_refused_offload_choice_is_gone():
    with pytest.raises(ShardfitError, match=r"parallel.offload: 'optimizer' is not allowed; fix: choose one of none, "
                                            r"all$"):
        load_config(None, ["--parallel.offload=optimizer"])


def test_train_help_shows_the_compute_section_and_names_the_new_spelling(capsys):
    from shardfit.cli.main import main

    assert main(["train", "--parallel.compile=true", "--help"]) == 0
    out, err = capsys.readouterr()
    compute = out.split("[compute]\n")[1].split("\n[")[0]
    assert "--compute.compile=true" in compute and "--compute.fp8=" in compute and "--parallel." not in compute
    assert "--parallel.compile" not in out and "--parallel.offload=" in out
    assert err.count("\n") == 1 and "parallel.compile is now compute.compile" in err
