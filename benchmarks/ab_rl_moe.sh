set -u; export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in old new old2 new2; do
  if [ "${t#old}" != "$t" ]; then d=.old; else d=.; fi
  (cd $d && RL_PARTS=moe/shardfit RL_TAG=$t RL_LOGPROBS_AT=counted RL_CAP=150 RL_MOE_PROF=0 OUT=$OUT bash benchmarks/device_run.sh rl-moe > $OUT/ab_$t.txt 2>&1)
  tail -3 $OUT/ab_$t.txt
done
python3 - <<'PY'
import json, os, glob
out = os.environ["OUT"]
def walk(o, acc):
    if isinstance(o, dict):
        if "real_tok_s" in o: acc.append(o)
        for v in o.values(): walk(v, acc)
    elif isinstance(o, list):
        for v in o: walk(v, acc)
for t in ("old", "new", "old2", "new2"):
    p = f"{out}/rl-moe-{t}.json"
    if not os.path.exists(p): print(t, "missing"); continue
    acc = []; walk(json.load(open(p)), acc)
    print(t, [(x.get("what") or x.get("tag") or x.get("part"), round(x["real_tok_s"])) for x in acc])
PY
