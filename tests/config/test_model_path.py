"""model.path given as a Hugging Face Hub id: found in the local cache as huggingface_hub lays it out, or refused in
one line that gives the download command; local directories are untouched."""

import json

import pytest

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from tests.config.test_defaults import ONE_B


def _cache_snapshot(cache, hub_id, revision, with_ref=True):
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(ONE_B))
    if with_ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision + "\n")
    return snap


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"])
def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path, monkeypatch, env):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env, str(tmp_path))
    cache = {"HF_HUB_CACHE": tmp_path, "HF_HOME": tmp_path / "hub",
             "XDG_CACHE_HOME": tmp_path / "huggingface" / "hub"}[env]
    _cache_snapshot(cache, "acme/llama-1b", "0123abc", with_ref=False)
    snap = _cache_snapshot(cache, "acme/llama-1b-x", "feedbee")
    cfg = load_config(None, ["--model.path=acme/llama-1b-x"])
    assert cfg.model.path == str(snap) and cfg.model.dim == 2048 and cfg.model.name == "llama"
    assert load_config(None, ["--model.path=acme/llama-1b"]).model.path.endswith("0123abc")


def test_an_uncached_hub_id_is_one_line_with_the_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ShardfitError) as e:
        load_config(None, ["--model.path=meta-llama/Llama-3.1-8B"])
    text = str(e.value)
    assert "huggingface-cli download meta-llama/Llama-3.1-8B" in text and str(tmp_path) in text
    assert "\n" not in text


def test_a_local_directory_wins_and_a_missing_path_keeps_its_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "acme" / "m"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps(ONE_B))
    assert load_config(None, ["--model.path=acme/m"]).model.path == "acme/m"
    with pytest.raises(ShardfitError) as e:
        load_config(None, [f"--model.path={tmp_path}/nowhere"])
    assert "model directory not found" in str(e.value) and "huggingface-cli" not in str(e.value)
