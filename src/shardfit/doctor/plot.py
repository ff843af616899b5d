"""Pictures of a diagnosis: memory over time stacked by category, and per-rank peaks (matplotlib, optional)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from shardfit.doctor.diagnose import Finding, RankResult
from shardfit.doctor.report import to_text, verdict
from shardfit.errors import ShardfitError

GiB = 1 << 30
_ORDER = ("parameters", "gradients", "optimizer_state", "activations", "fsdp_all_gather", "fsdp_reduce_scatter",
          "logits_loss", "other", "unknown", "before recording")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardfitError("pictures need matplotlib", where="--png/--html",
                            fix="pip install 'shardfit[plot]'") from None
    return plt


def render_png(results: list[RankResult], findings: list[Finding]) -> bytes:
    plt = _pyplot()
    n = len(results)
    fig = plt.figure(figsize=(13, 4.2 * n + (3.2 if n > 1 else 0)), dpi=100)
    grid = fig.add_gridspec(n + (1 if n > 1 else 0), 1, hspace=0.45)
    colors = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(_ORDER)}
    for row, x in enumerate(results):
        r = x.replay
        ax = fig.add_subplot(grid[row])
        if r.samples:
            t0 = r.times[0]
            xs = [(r.times[j] - t0) / 1e6 for j, _ in r.samples]
            cats = [c for c in _ORDER if any(s.get(c) for _, s in r.samples)]
            ax.stackplot(xs, [[s.get(c, 0) / GiB for _, s in r.samples] for c in cats], labels=cats,
                         colors=[colors[c] for c in cats], alpha=0.85)
            ax.plot([(t - t0) / 1e6 for t in r.times], [v / GiB for v in r.reserved], color="black", lw=1.2,
                    label="reserved")
            peak_t = (r.times[r.peak_index] - t0) / 1e6
            ax.axvline(peak_t, color="red", ls="--", lw=1)
            ax.set_ylim(0, max(r.reserved) / GiB * 1.35)  # headroom above the lines for the legend
            ax.text(0.995, 0.97, f"peak (red line): {r.peak.allocated / GiB:.2f} GiB allocated, "
                    f"{r.peak.reserved / GiB:.2f} GiB reserved", transform=ax.transAxes, ha="right", va="top",
                    fontsize=8, color="red")
            for ev, _lay in r.ooms:
                ax.axvline((ev.get("time_us", t0) - t0) / 1e6, color="darkred", lw=2)
            ax.set_xlabel("seconds since recording began")
            ax.legend(fontsize=7, loc="upper left", ncol=4, framealpha=0.8)
        else:
            ax.bar(list(r.end.categories), [v / GiB for v in r.end.categories.values()],
                   color=[colors.get(c, "grey") for c in r.end.categories])
            ax.set_xlabel("no trace recorded: live memory at dump by category")
        ax.set_ylabel("GiB")
        ax.set_title(f"rank {x.rank}: {Path(x.path).name}", fontsize=10, loc="left")
    if n > 1:
        ax = fig.add_subplot(grid[n])
        ranks = [f"rank {x.rank}" for x in results]
        bottom = [0.0] * n
        for c in _ORDER:
            vals = [x.replay.peak.categories.get(c, 0) / GiB for x in results]
            if any(vals):
                ax.bar(ranks, vals, bottom=bottom, color=colors[c], label=c)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(ranks, [x.replay.peak_reserved / GiB for x in results], color="black", marker="_", s=900,
                   label="peak reserved", zorder=3)
        ax.set_ylim(0, max(x.replay.peak_reserved for x in results) / GiB * 1.35)  # room for the legend
        ax.set_ylabel("GiB at each rank's peak")
        ax.set_title("per-rank peak: allocated by category, and reserved", fontsize=10, loc="left")
        ax.legend(fontsize=7, ncol=4, loc="upper left")
    fig.suptitle("shardfit doctor: " + verdict(findings), fontsize=11, x=0.01, ha="left")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def render_html(results: list[RankResult], findings: list[Finding], png: bytes) -> str:
    img = base64.b64encode(png).decode()
    return (f"<!doctype html><meta charset='utf-8'><title>shardfit doctor</title>"
            f"<style>body{{font-family:sans-serif;margin:2em}}pre{{background:#f6f6f6;padding:1em}}</style>"
            f"<h1>shardfit doctor</h1><p><b>{html.escape(verdict(findings))}</b></p>"
            f"<img alt='memory timeline' style='max-width:100%' src='data:image/png;base64,{img}'>"
            f"<pre>{html.escape(to_text(results, findings))}</pre>")
