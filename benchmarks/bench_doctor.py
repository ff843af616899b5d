"""Time `shardfit doctor` on a generated snapshot of N trace events (default 1,000,000).

  python benchmarks/bench_doctor.py [--events 1000000] [--keep FILE]

The trace mimics a training loop: 64 segments, tensors of many sizes on two streams, each allocation with an
8-frame Python stack, every tensor freed (free_requested + free_completed), a few left live at the dump.
Reports file size, wall time and peak RSS of the analysis (a fresh process: load, replay, diagnose, report).
"""

from __future__ import annotations

import argparse
import pickle
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1 << 20


def generate(n_events: int, path: Path) -> None:
    rnd = random.Random(0)
    base, seg_size, n_segs = 0x7F0000000000, 256 * MB, 64
    frames = [[{"name": f"fn{d}", "filename": f"torch/nn/modules/mod{d}.py", "line": 10 * d + k}
               for d in range(8)] for k in range(50)]
    trace, live = [], []
    segments = [{"device": 0, "address": base + i * seg_size, "total_size": seg_size, "stream": i % 2,
                 "segment_type": "large", "is_expandable": False, "frames": [], "blocks": []} for i in range(n_segs)]
    for i in range(n_segs):
        trace.append({"action": "segment_alloc", "addr": base + i * seg_size, "size": seg_size, "stream": i % 2,
                      "time_us": i, "frames": frames[0]})
    cursor = [0] * n_segs
    t = n_segs
    while len(trace) < n_events:
        t += 1
        if live and (rnd.random() < 0.5 or len(live) > 2000):
            seg, addr, size = live.pop(rnd.randrange(len(live)))
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": addr, "size": size, "stream": seg % 2, "time_us": t,
                              "frames": []})
            continue
        seg = rnd.randrange(n_segs)
        size = rnd.choice((512, 4096, MB, 2 * MB, 4 * MB))
        if cursor[seg] + size > seg_size:
            cursor[seg] = 0
        addr = base + seg * seg_size + cursor[seg]
        cursor[seg] += size
        if any(a == addr for _, a, _ in live):
            continue
        live.append((seg, addr, size))
        trace.append({"action": "alloc", "addr": addr, "size": size, "stream": seg % 2, "time_us": t,
                      "frames": frames[rnd.randrange(50)]})
    for seg, addr, size in live:  # still live at the dump
        segments[seg]["blocks"].append({"address": addr, "size": size, "requested_size": size,
                                        "state": "active_allocated", "frames": []})
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [trace], "allocator_settings": {},
                                   "external_annotations": []}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--keep", default="")
    a = ap.parse_args()
    path = Path(a.keep or tempfile.mkstemp(suffix=".pickle")[1])
    generate(a.events, path)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", (
        "import sys; from shardfit.doctor import examine; from shardfit.doctor.report import to_text; "
        "r, f = examine([sys.argv[1]]); to_text(r, f); "
        # VmHWM: this process image's peak RSS. Not ru_maxrss: after fork+exec Linux folds the parent's high-water
        # mark into it, and the parent here holds the generated trace (~450 MB of dicts).
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"), str(path)],
        capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        print(p.stderr)
        return 1
    rss = int(p.stdout.split()[-1]) * 1024
    size = path.stat().st_size
    print(f"events {a.events:,} | file {size / MB:.0f} MiB | doctor wall {wall:.1f} s | peak RSS {rss / MB:.0f} MiB "
          f"({rss / size:.2f}x the file)")
    if not a.keep:
        path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
