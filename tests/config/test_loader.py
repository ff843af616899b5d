import pytest

from shardfit.config import Config, config_to_toml, load_config
from shardfit.config.loader import config_help
from shardfit.errors import ShardfitError


def test_defaults_are_the_tiny_preset():
    cfg = load_config()
    assert cfg.model.name == "tiny" and cfg.data.tokenizer == "byte"
    assert cfg.model.vocab_size >= 259  # covers the byte tokenizer


def test_toml_then_cli_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[train]\nlr = 1e-4\nsteps = 7\n[model]\nname = "llama3-8b"\nn_layers = 2\n')
    cfg = load_config(f, ["--train.steps=9", "--compute.activation_checkpoint", "full"])
    assert cfg.train.lr == 1e-4 and cfg.train.steps == 9
    assert cfg.compute.activation_checkpoint == "full"
    assert cfg.model.dim == 4096 and cfg.model.vocab_size == 128256  # from the preset
    assert cfg.model.n_layers == 2  # explicit beats preset


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--model.name=llama3-1b", "--data.path=x y\"z", "--train.grad_clip=0"])
    f = tmp_path / "c.toml"
    f.write_text(config_to_toml(cfg))
    assert load_config(f) == cfg


@pytest.mark.parametrize("args, needle", [
    (["--train.lrr=1"], "did you mean 'train.lr'"),
    (["--trian.lr=1"], "did you mean 'train'"),
    (["--train.steps=ten"], "--train.steps: 'ten' is not a whole number; fix: give a whole number"),
    (["--train.steps=0"], "train.steps: 0 is out of range; fix: give a value > 0"),
    (["--model.n_heads=0"], "model.n_heads: 0 is out of range"),  # before the model is built to size the defaults
    (["--model.dim=-5"], "model.dim: -5 is out of range"),
    (["--compute.activation_checkpoint=some"], "choose one of none, full, selective"),
    (["--model.name=llama9"], "unknown model preset"),
    (["--data.seq_len=4096"], "above the model's limit"),
    (["--train.global_batch=10", "--train.micro_batch=4"], "not a multiple of micro_batch"),
    (["--model.n_kv_heads=3"], "not a multiple of n_kv_heads"),
    (["train.lr=1"], "write overrides as --section.key=value"),
    (["--train.lr"], "--train.lr needs a value; fix: write --train.lr=VALUE"),
])
def test_bad_config_names_key_and_fix(args, needle):
    with pytest.raises(ShardfitError) as e:
        load_config(None, args)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_bad_toml_names_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train\nlr = 1\n")
    with pytest.raises(ShardfitError, match=r"bad.toml: malformed TOML"):
        load_config(f)
    f.write_text('[train]\nlr = "fast"\n')
    with pytest.raises(ShardfitError, match=r"bad.toml train.lr: expected a number"):
        load_config(f)
    with pytest.raises(ShardfitError, match="config file not found"):
        load_config(tmp_path / "missing.toml")


AXOLOTL = "base_model: Qwen/Qwen2.5-0.5B\nlearning_rate: 0.0002\nmicro_batch_size: 2\n"
FIX = ("fix: write it as TOML: a [section] line, then key = value lines (a YAML `train: {lr: 1e-4}` is `[train]` then "
       "`lr = 1e-4`); `shardfit train --help` lists the keys, the recipes (`shardfit recipes`) are examples")


@pytest.mark.parametrize("name, text, what", [
    ("axolotl.yaml", AXOLOTL, "shardfit configs are TOML, not YAML"),
    ("tune.YML", "# torchtune\nmodel:\n  _component_: x\n", "shardfit configs are TOML, not YAML"),
    ("missing.yaml", None, "shardfit configs are TOML, not YAML"),  # named for what it is, found or not
    ("run.toml", "# a YAML file under a .toml name\n" + AXOLOTL, "this is YAML: shardfit configs are TOML"),
    ("doc.toml", "---\ntrain: {lr: 1}\n", "this is YAML: shardfit configs are TOML"),
])
def test_a_yaml_config_is_named_yaml_with_the_fix(tmp_path, name, text, what):
    """Users of axolotl and torchtune bring YAML: one line says so and how to write TOML, not "malformed TOML"."""
    f = tmp_path / name
    if text is not None:
        f.write_text(text)
    with pytest.raises(ShardfitError) as e:
        load_config(f)
    assert str(e.value) == f"{f}: {what}; {FIX}"


def test_malformed_toml_that_is_not_yaml_stays_malformed_toml(tmp_path):
    f = tmp_path / "c.toml"
    for text in ("[train]\nlr: 1\n", "[train\n", "lr == 1\n"):  # TOML's own mistakes, even one colon inside
        f.write_text(text)
        with pytest.raises(ShardfitError, match=r"c.toml: malformed TOML \(.*fix: fix the TOML syntax$"):
            load_config(f)


def test_help_lists_every_key():
    text = config_help()
    cfg = Config()
    sections = list(vars(cfg))
    assert sections == ["model", "lora", "data", "train", "parallel", "compute", "checkpoint", "logging", "memory",
                        "preference", "serve", "sampling"]
    for section in sections:
        assert f"[{section}]" in text
        for key in vars(getattr(cfg, section)):
            assert f"--{section}.{key}=" in text


@pytest.mark.parametrize("key", ["tensorboard", "wandb"])
def test_a_tracker_without_its_package_is_refused_before_launch(monkeypatch, key):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == key else real(name, *a))
    with pytest.raises(ShardfitError, match=rf"logging.{key}: logging.{key}=true needs the {key} package; "
                                            rf"fix: pip install 'shardfit\[{key}\]'"):
        load_config(None, [f"--logging.{key}=true"])
