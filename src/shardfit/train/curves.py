"""A run's numbers as one picture: metrics.jsonl read back and drawn into a PNG (matplotlib, a dependency).

`read_metrics` reads the records as plotting tools need them: train and eval records apart (their "kind"), and
the records a later process redid dropped (a record with "start_step" S, the first of each process, supersedes every
earlier record of a step after S: a resume from an older checkpoint, or a new run from scratch in the directory).
`render` draws four panels against the step, with the tokens seen on a second axis: training and validation loss,
learning rate, tokens/s per GPU, and memory (peak allocated and reserved on CUDA, the host's peak resident set on
the CPU); several runs overlay. The PNG carries a summary of every series it drew (text chunk "Description", JSON),
so a test, or a reader, can check the picture against metrics.jsonl. `shardfit plot` draws one on demand; the trainer
draws <run_dir>/metrics.png at the end of every run (logging.plot), or says in one line why it could not.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.fsutil import write_atomic

PNG = "metrics.png"
PANELS = (("loss", ("loss", "val_loss"), None), ("learning rate", ("lr",), None),
          ("tokens/s per GPU", ("tokens_per_s_per_gpu",), None), ("memory", ("peak_allocated_max",
                                                                               "peak_reserved_max"), "GiB"))


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a metrics.jsonl, each in step order, one per step (the latest written)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ShardfitError(f"cannot read the run's metrics ({e.strerror or e})", where=str(path),
                            fix="give a run directory (it holds metrics.jsonl once a step has been logged)") from None
    records: list[dict] = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break  # the last line of a process killed while writing it
            raise ShardfitError("not a JSON record", where=str(path), line=i + 1,
                                fix="restore metrics.jsonl (one JSON object per line, as shardfit writes it)") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            continue
        if isinstance(rec.get("start_step"), int):
            records = [r for r in records if r["step"] <= rec["start_step"]]
        records.append(rec)
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for rec in records:
        is_eval = rec.get("kind") == "eval" or rec.get("eval") is True
        (evals if is_eval else train)[rec["step"]] = rec
    return [train[k] for k in sorted(train)], [evals[k] for k in sorted(evals)]


def series(train: list[dict], evals: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) for every panel's field the records hold (None and non-numbers left out)."""
    out = {}
    cpu = bool(train) and train[-1].get("device") == "cpu"  # one figure for memory: the host's peak resident set
    for _, fields, _ in PANELS:
        for name in fields:
            if cpu and name == "peak_reserved_max":
                continue
            recs = evals if name.startswith("val_") else train
            pts = [(r["step"], float(r[name])) for r in recs
                   if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool)]
            if pts:
                out[name] = ([s for s, _ in pts], [v for _, v in pts])
    return out


def summary(data: dict[str, tuple[list[int], list[float]]]) -> dict:
    return {name: {"n": len(v), "steps": [s[0], s[-1]], "first": v[0], "last": v[-1], "min": min(v), "max": max(v)}
            for name, (s, v) in data.items()}


def _pyplot(where: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        # a dependency of shardfit: missing only from an install that skipped them (pip install --no-deps)
        raise ShardfitError("drawing needs matplotlib, which is not installed", where=where,
                            fix="pip install matplotlib") from None
    return plt


def render(runs: list[Path], where: str = "shardfit plot") -> bytes:
    """The PNG of these run directories' metrics (several: overlaid, one colour each)."""
    loaded = []
    for run in runs:
        train, evals = read_metrics(Path(run) / "metrics.jsonl")
        if not train and not evals:
            raise ShardfitError("no step has been logged yet", where=str(Path(run) / "metrics.jsonl"),
                                fix="plot once the run has logged a step (logging.log_every)")
        loaded.append((Path(run), train, series(train, evals)))
    plt = _pyplot(where)
    from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), dpi=100)
    colors = plt.get_cmap("tab10")
    for i, (run, train, data) in enumerate(loaded):
        label = run.name if len(loaded) > 1 else ""
        for ax, (title, fields, unit) in zip(axes.flat, PANELS):
            for j, name in enumerate(fields):
                if name not in data:
                    continue
                steps, values = data[name]
                marker = "o" if name.startswith("val_") or len(steps) == 1 else None
                ax.plot(steps, values, "--" if j else "-", marker=marker, markersize=3, color=colors(i % 10),
                        label=" ".join(filter(None, (label, _legend(name, train)))))
            if title.endswith(" per GPU") and train and train[-1].get("device") == "cpu":
                title = title.replace(" per GPU", " per process")  # no GPU to divide by
            ax.set_title(title + (f" ({unit})" if unit else ""), fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    for ax, (title, _fields, _unit) in zip(axes.flat, PANELS):
        if ax.lines:
            ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if title == "learning rate":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
    if len(loaded) == 1:
        _tokens_axis(axes, loaded[0][1], EngFormatter())
    fig.suptitle(", ".join(str(r) for r, _, _ in loaded), fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    described = {str(run): summary(data) for run, _, data in loaded}
    fig.savefig(buf, format="png", metadata={"Software": "shardfit", "Description": json.dumps(described)})
    plt.close(fig)
    return buf.getvalue()


def _legend(name: str, train: list[dict]) -> str:
    cpu = bool(train) and train[-1].get("device") == "cpu"
    return {"loss": "train loss", "val_loss": "validation loss", "lr": "lr", "tokens_per_s_per_gpu": "tokens/s",
            "peak_allocated_max": ("host peak RSS" + (", max process" if train[-1].get("world", 1) > 1 else "")
                                   if cpu else "peak allocated, max rank"),
            "peak_reserved_max": "peak reserved, max rank"}.get(name, name)


def _tokens_axis(axes, train: list[dict], formatter) -> None:
    """The tokens seen as a second x axis of every panel, interpolated from the train records' (step, tokens)."""
    import numpy as np

    pts = [(r["step"], r["tokens_seen"]) for r in train if isinstance(r.get("tokens_seen"), (int, float))]
    if len(pts) < 2 or pts[-1][1] <= pts[0][1]:
        return
    steps, tokens = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    tokens = np.maximum.accumulate(tokens)

    def along(x, xs, ys):  # piecewise linear through the records, extended straight beyond them
        x = np.asarray(x, float)
        slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        y = np.interp(x, xs, ys)
        return np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * slope, np.where(x < xs[0], ys[0] + (x - xs[0]) * slope, y))

    for ax in axes.flat:
        top = ax.secondary_xaxis("top", functions=(lambda s: along(s, steps, tokens),
                                                   lambda t: along(t, tokens, steps)))
        top.xaxis.set_major_formatter(formatter)
        top.set_xlabel("tokens", fontsize=8)


def plot_run(runs: list[Path], out: Path, where: str = "shardfit plot") -> Path:
    write_atomic(out, render(runs, where))
    return out


def end_of_run(run_dir: Path) -> str:
    """The trainer's last picture: the line to print (where it went, or why there is none)."""
    try:
        return f"plotted {plot_run([run_dir], run_dir / PNG, 'logging.plot')}"
    except ShardfitError as e:
        return f"no {PNG}: {e.what} ({e.fix}; or logging.plot=false)"
    except OSError as e:
        return f"no {PNG}: could not write it ({e.strerror or e})"
