"""Wall-clock ms per step from a `shardfit train --logging.progress=lines` log whose lines were timestamped as they
arrived (`while read l; do echo "$(date +%s.%N) $l"; done`): (t[last] - t[first]) / steps, independent of how the
run measures itself. Usage: python benchmarks/wall_per_step.py LOG FIRST LAST"""

import re
import sys

log, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = {}
with open(log) as f:
    for line in f:
        m = re.match(r"([\d.]+) step (\d+)/\d+ ", line)
        if m:
            t[int(m.group(2))] = float(m.group(1))
print(f"{log}: {(t[last] - t[first]) / (last - first) * 1e3:.2f} ms/step (steps {first}-{last}, wall clock)")
