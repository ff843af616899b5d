"""Other tools' spellings (HF Trainer, torchtune, axolotl) get shardfit's key in the one error line, bare or under a
section, on the command line or in a TOML file; anything else keeps the generic advice."""

import pytest

from shardfit.config import load_config
from shardfit.config.spellings import FOREIGN
from shardfit.errors import ShardfitError


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


def test_every_target_is_a_real_key():
    """A translation must name a key that exists: a renamed key breaks this test, not the user's next error."""
    from shardfit.config.loader import _fields, _sections
    from shardfit.config.schema import Config

    keys = {f"{s}.{k}" for s, obj in _sections(Config()).items() for k in _fields(obj)}
    for foreign, ours in FOREIGN.items():
        named = ours.split()[0].split("=")[0]
        if named.endswith("*"):  # a section
            continue
        assert named in keys, (foreign, ours)
