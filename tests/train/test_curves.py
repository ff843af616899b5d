"""Issue 27, class 3: metrics.jsonl read as plotting tools need it (train and eval records apart, records a later
process redid dropped) and drawn into a valid PNG that carries the numbers it drew."""

from __future__ import annotations

import io
import json

import pytest

from shardfit.errors import ShardfitError
from shardfit.train.curves import read_metrics, render, series
from shardfit.train.progress import Progress


def _train(step, loss, **kw):
    return {"kind": "train", "step": step, "loss": loss, "lr": 1e-3 * step, "tokens_seen": 100 * step,
            "tokens_per_s_per_gpu": 1000.0 + step, "peak_allocated_max": 0.5, "device": "cpu", **kw}


def _eval(step, val):
    return {"kind": "eval", "step": step, "val_loss": val, "val_tokens": 64, "val_s": 0.1, "eval": True}


@pytest.mark.parametrize("lines, train_steps, eval_steps, losses", [
    ([_train(1, 5.0, start_step=0), _train(2, 4.0), _eval(2, 4.5)], [1, 2], [2], [5.0, 4.0]),
    # resumed from step 2 after a run that got to step 4 (its steps 3-4 and the eval of step 4 were redone)
    ([_train(1, 5.0, start_step=0), _train(2, 4.0), _train(3, 3.9), _eval(4, 9.0), _train(4, 3.8),
      _train(3, 3.5, start_step=2), _train(4, 3.4)], [1, 2, 3, 4], [], [5.0, 4.0, 3.5, 3.4]),
    # a new run from scratch in the directory: the old records go
    ([_train(1, 5.0, start_step=0), _train(2, 4.0), _train(1, 6.0, start_step=0)], [1], [], [6.0]),
    # an older shardfit's records: no kind, "eval": true on evaluations; a last line cut short by a kill
    ([{k: v for k, v in _train(1, 5.0).items() if k != "kind"}, {**_eval(1, 5.5), "kind": None}, '{"step": 2, "lo'],
     [1], [1], [5.0]),
])
def test_records_are_read_apart_and_redone_steps_dropped(tmp_path, lines, train_steps, eval_steps, losses):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    train, evals = read_metrics(path)
    assert [r["step"] for r in train] == train_steps and [r["step"] for r in evals] == eval_steps
    assert series(train, evals)["loss"] == (train_steps, losses)


def test_a_broken_line_in_the_middle_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ShardfitError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_progress_tags_every_record_and_marks_where_it_started(tmp_path):
    for start, steps in ((0, (1, 2, 3)), (2, (3,))):  # a run, then a resume from its step-2 checkpoint
        p = Progress(tmp_path, 3, start, "none", enabled=True, logging={})
        for s in steps:
            p.log(_train(s, 4.0 - s / 10))
        p.log_eval({"step": steps[-1], "val_loss": 3.0, "val_tokens": 8, "val_s": 0.0})
        p.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r.get("start_step")) for r in recs] == [
        ("train", 1, 0), ("train", 2, None), ("train", 3, None), ("eval", 3, None), ("train", 3, 2), ("eval", 3, None)]
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3] and train[-1]["start_step"] == 2 and len(evals) == 1


def test_render_is_a_png_of_these_numbers(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    for name, offset in (("a", 0.0), ("b", 1.0)):
        (tmp_path / name).mkdir()
        recs = [_train(s, 5.0 - s / 10 + offset, **({"start_step": 0} if s == 1 else {})) for s in range(1, 6)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*recs, _eval(5, 4.7)]))
    png = render([tmp_path / "a", tmp_path / "b"])
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.size == (1200, 750)
    drawn = json.loads(image.info["Description"])
    assert drawn[str(tmp_path / "b")]["loss"] == {"n": 5, "steps": [1, 5], "first": 5.9, "last": 5.5, "min": 5.5,
                                                  "max": 5.9}
    assert drawn[str(tmp_path / "a")]["val_loss"]["last"] == 4.7 and "lr" in drawn[str(tmp_path / "a")]
