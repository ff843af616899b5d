"""config/spellings.py: old spellings load as the new keys with one notice line per key per run (both spellings of
one key in one source is an error naming both); other tools' spellings (HF Trainer, TRL, torchtune, axolotl) get
shardfit's key, or what to do where shardfit has none, bare or under a section, on the command line or in a TOML
file; a typo gets "did you mean" only for a really close key."""

import dataclasses
import re

import pytest

from shardfit.config import ComputeConfig, Config, config_to_toml, load_config, spellings
from shardfit.errors import ShardfitError


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test as a new run: nothing announced yet, not a rank of a launch."""
    monkeypatch.setattr(spellings, "_announced", set())
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


COMPUTE = [(f.name, _other_value(f)) for f in dataclasses.fields(ComputeConfig)
           if f.name not in spellings.NEW_IN_COMPUTE]


def test_every_compute_key_has_its_old_spelling():
    assert {f"parallel.{k}": f"compute.{k}" for k, _ in COMPUTE} == spellings.RENAMED
    assert len(COMPUTE) == 13  # the keys of issue 26's split: a key moved later needs its own entry here
    assert "parallel.ac_blocks" not in spellings.RENAMED  # added to [compute] since: no old spelling


@pytest.mark.parametrize("key, value", COMPUTE)
def test_old_spelling_on_the_command_line_is_the_new_key_with_one_notice(key, value, capsys):
    full = ["--compute.activation_checkpoint=full"] if key == "ac_every" else []  # it picks blocks of full AC
    old = load_config(None, [f"--parallel.{key}={value}", *full])
    line = capsys.readouterr().err
    assert line == (f"shardfit: parallel.{key} is now compute.{key}; the old spelling is accepted until "
                    f"{spellings.UNTIL}\n")
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
    compute = "\n".join(x for x in compute.splitlines() if x.split(" = ")[0] not in spellings.NEW_IN_COMPUTE)
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
        monkeypatch.setattr(spellings, "_announced", set())
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


@pytest.mark.parametrize("arg, key", [
    ("--learning_rate=1e-4", "train.lr"), ("--train.learning_rate=1e-4", "train.lr"),
    ("--per_device_train_batch_size=4", "train.micro_batch"), ("--micro_batch_size=4", "train.micro_batch"),
    ("--gradient_accumulation_steps=8", "train.global_batch"), ("--max-seq-length=2048", "data.seq_len"),
    ("--data.max_seq_length=512", "data.seq_len"), ("--sequence_len=512", "data.seq_len"),
    ("--num_train_epochs=3", "train.epochs"), ("--output_dir=x", "logging.run_dir"),
])
def test_foreign_spellings_name_the_key(arg, key):
    with pytest.raises(ShardfitError) as e:
        load_config(None, [arg])
    assert f"is {key}" in str(e.value) and "min_lr_ratio" not in str(e.value)


def test_in_a_toml_file_too(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nlearning_rate = 1e-4\n")
    with pytest.raises(ShardfitError) as e:
        load_config(f)
    assert "c.toml" in str(e.value) and "is train.lr" in str(e.value)


@pytest.mark.parametrize("arg, needle", [("--frobnicate=3", "write overrides as --section.key=value"),
                                         ("--train.stepz=3", "did you mean 'train.steps'")])
def test_unknown_spellings_keep_the_generic_advice(arg, needle):
    with pytest.raises(ShardfitError) as e:
        load_config(None, [arg])
    assert needle in str(e.value)


KEYS = {s: [f.name for f in dataclasses.fields(obj)] for s, obj in vars(Config()).items()}


def test_every_key_they_name_is_a_real_key():
    """A translation or advice must name keys that exist: a renamed key breaks this test, not the user's next error."""
    keys = {f"{s}.{k}" for s, names in KEYS.items() for k in names}
    for table in (spellings.FOREIGN, spellings.NOT_A_KEY):
        for foreign, text in table.items():
            named = re.findall(r"\b([a-z]+\.[a-z_0-9]+)\b", text)
            assert named or table is spellings.NOT_A_KEY, (foreign, text)
            assert all(n in keys for n in named if n.split(".")[0] in KEYS), (foreign, text)


# issue 38: string similarity named an unrelated key for each of these
@pytest.mark.parametrize("name, says, not_said", [
    ("lr_scheduler", "'lr_scheduler' is not a shardfit key: the schedule is linear warm-up", "'train.seed'"),
    ("lr_scheduler_type", "cosine decay to train.lr x train.min_lr_ratio", "'train.seed'"),
    ("optim", "'optim' is not a shardfit key: the optimizer is AdamW", "'train.eps'"),
    ("packing", "'packing' is data.pack (fine-tuning examples packed", "'train.epochs'"),
    ("trust_remote_code", "'trust_remote_code' is not a shardfit key: shardfit runs its own implementation",
     "'model.router_aux_coef'"),
])
@pytest.mark.parametrize("spelled", ["--{name}=x", "--train.{name}=x", "--model.{name}=x", "file"])
def test_other_tools_keys_are_answered_by_name_not_by_likeness(name, says, not_said, spelled, tmp_path):
    if spelled == "file":
        f = tmp_path / "c.toml"
        f.write_text(f'[train]\n{name} = "x"\n')
        args: tuple = (f, [])
    else:
        args = (None, [spelled.format(name=name)])
    with pytest.raises(ShardfitError) as e:
        load_config(*args)
    msg = str(e.value)
    assert says in msg and not_said not in msg and "did you mean" not in msg and "\n" not in msg


@pytest.mark.parametrize("name, meant", [("stpes", "steps"), ("lrr", "lr"), ("stepz", "steps"), ("sed", "seed"),
                                         ("warmup", "warmup_steps"), ("grad_clipping", "grad_clip"),
                                         ("warmup_step", "warmup_steps"), ("global_bacth", "global_batch")])
def test_a_typo_is_close_to_the_key_it_meant(name, meant):
    assert spellings.close_to(name, meant) and spellings.closest(name, KEYS["train"]) == meant


@pytest.mark.parametrize("name, other", [("lr_scheduler", "seed"), ("optim", "eps"), ("packing", "epochs"),
                                         ("trust_remote_code", "router_aux_coef"), ("eval", "eval_every"),
                                         ("lr", "lrs_and_more"), ("steps_per_epoch", "steps")])
def test_unrelated_names_are_not_close(name, other):
    assert not spellings.close_to(name, other)


def test_an_unknown_key_with_no_close_one_lists_its_section_and_a_close_one_elsewhere_is_named():
    with pytest.raises(ShardfitError) as e:
        load_config(None, ["--train.lr_decay=0.5"])
    assert str(e.value) == ("--train.lr_decay: unknown key 'train.lr_decay'; fix: [train] has "
                            + ", ".join(KEYS["train"]) + " (shardfit train --help explains each)")
    with pytest.raises(ShardfitError, match=r"unknown key 'train.pack'; fix: did you mean 'data.pack'\?"):
        load_config(None, ["--train.pack=false"])
    with pytest.raises(ShardfitError, match=r"unknown section 'dataset'; fix: did you mean 'data'\?"):
        load_config(None, ["--dataset.path=x"])


@pytest.mark.parametrize("arg, fix", [("--seq_len=128", "write --data.seq_len: an option names its section"),
                                      ("--every", "write --checkpoint.every: an option names its section"),
                                      ("--steps=3", "write --train.steps: an option names its section")])
def test_a_key_without_its_section_is_named_with_it(arg, fix):
    with pytest.raises(ShardfitError) as e:
        load_config(None, [arg])
    assert str(e.value) == f"command line: cannot read argument '{arg}'; fix: {fix}"
