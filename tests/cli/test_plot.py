"""Issue 27, class 3: every run ends with <run_dir>/metrics.png, and `shardfit plot` draws one on demand: a valid
PNG of the run's real numbers (the summary it carries equals what metrics.jsonl holds, read independently here).
Without matplotlib a run still exits 0 and says so in one line; `shardfit plot` is then one error line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cli.test_cli import TINY, _run

ARGS = [*(a for a in TINY if a != "--logging.plot=false"), "--train.steps=6", "--train.eval_every=2",
        "--data.val_fraction=0.1"]
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from shardfit.cli.main import entry; entry()"


def _expected(run) -> dict:
    """What the picture must show, from metrics.jsonl as any reader parses it."""
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    out = {}
    for name, kind in (("loss", "train"), ("val_loss", "eval"), ("lr", "train"), ("tokens_per_s_per_gpu", "train"),
                       ("peak_allocated_max", "train")):
        pts = [(r["step"], r[name]) for r in recs if r["kind"] == kind]
        v = [x for _, x in pts]
        out[name] = {"n": len(v), "steps": [pts[0][0], pts[-1][0]], "first": v[0], "last": v[-1], "min": min(v),
                     "max": max(v)}
    return out


def _drawn(png) -> dict:
    from PIL import Image

    image = Image.open(png)
    image.verify()  # a whole, valid PNG
    image = Image.open(png)
    assert image.format == "PNG" and image.size == (1200, 750)
    return json.loads(image.info["Description"])


def test_every_run_ends_with_a_png_of_its_numbers_and_plot_redraws_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    p = _run("train", *ARGS, f"--logging.run_dir={run}")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == f"plotted {run / 'metrics.png'}"
    want = _expected(run)
    assert want["loss"]["n"] == 6 and want["val_loss"]["n"] == 3 and want["val_loss"]["steps"] == [2, 6]
    assert _drawn(run / "metrics.png")[str(run)] == want

    from shardfit.cli.main import main  # `shardfit plot` (in this process: one interpreter start less)

    assert main(["plot", str(run), "--out", str(tmp_path / "again.png")]) == 0
    assert capsys.readouterr().out.strip() == f"plotted {tmp_path / 'again.png'}"
    assert _drawn(tmp_path / "again.png")[str(run)] == want


def test_without_matplotlib_a_run_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", NO_MATPLOTLIB, "train", *ARGS, f"--logging.run_dir={run}"],
                       capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr
    said = [line for line in p.stdout.splitlines() if "metrics.png" in line]
    assert said == ["no metrics.png: drawing needs matplotlib, which is not installed (pip install matplotlib; or "
                    "logging.plot=false)"]
    assert not (run / "metrics.png").exists() and (run / "checkpoints" / "step_00000006").is_dir()

    from shardfit.cli.main import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(run)]) == 2
    assert capsys.readouterr().err == ("shardfit: error: shardfit plot: drawing needs matplotlib, which is not "
                                       "installed; fix: pip install matplotlib\n")


@pytest.mark.parametrize("argv, needle", [
    (["plot", "{tmp}"], "{tmp}: not a run directory (no metrics.jsonl)"),
    (["plot", "{tmp}/a", "{tmp}/b"], "{tmp}/a: not a run directory"),
    (["plot"], "the following arguments are required: RUN_DIR"),
])
def test_plot_refuses_what_it_cannot_draw_in_one_line(tmp_path, argv, needle, capsys):
    from shardfit.cli.main import main

    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle.format(tmp=tmp_path) in lines[0], lines


def test_several_runs_need_an_out(tmp_path, capsys):
    from shardfit.cli.main import main

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n")
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "2 runs and no --out" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "ab.png")]) == 0
    assert set(_drawn(tmp_path / "ab.png")) == {str(tmp_path / "a"), str(tmp_path / "b")}


def test_a_plain_install_draws_metrics_png():
    """The README's first command (`pip install torch==... -e . && shardfit train`) promises metrics.png: matplotlib
    is a dependency of shardfit itself, not of an extra."""
    import re
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    root = Path(__file__).parents[2]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"matplotlib\b", d) for d in deps), deps
    assert "metrics.png" in (root / "README.md").read_text()
