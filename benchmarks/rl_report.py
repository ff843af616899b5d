"""What benchmarks/bench_rl.py makes of its runs' JSON lines: the summary (summarize: the ratios against the anchor,
same data, parameters, weights/export rates, the server against in-process, and with --prof-out the two sides'
profiles kernel class by kernel class, profiles) and the printed tables (table). The summary's keys are
bench_rl.py's docstring's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_profile as rp  # noqa: E402
import rollouts as ro  # noqa: E402
from rl_worker_setup import LORA_RANK, TAG  # noqa: E402


def _get(rows: list[dict], part: str, system: str) -> list[dict]:
    return [x for r in rows if r.get("part") == part and r.get("system") == system for x in r.get("lines", [])]


def _sf(lines: list[dict], kind: str) -> dict | None:
    return next((x for x in reversed(lines) if x.get(TAG) == kind), None)


def _hf(lines: list[dict], part: str, layout: str | None = None) -> dict | None:
    """The anchor's fastest timed line of a part (profiled passes, tagged "profiled", are not figures)."""
    c = [x for x in lines if x.get("part") == part and "real_tok_s" in x and layout in (None, x.get("layout"))
         and x.get("tag") != "profiled"]
    return max(c, key=lambda x: x["real_tok_s"]) if c else None


def summarize(rows: list[dict], r: ro.Rollouts, a) -> dict:
    S: dict = {"rl_fwd_vs_hf": {}, "rl_fwdbwd_vs_hf": {}, "rl_fwd_vs_hf_default": {}, "rl_fwdbwd_vs_hf_default": {},
               "same_data": {}, "params": {}}
    keys = {"dense-fwd": f"dense-{a.fwd_shape}", "dense-ppo": f"dense-{a.ppo_shape}-full",
            "lora-ppo": f"dense-{a.fwd_shape}-lora16", "moe": f"moe-{a.moe_layers}L"}
    for part, key in keys.items():
        sf, hf = _get(rows, part, "shardfit"), _get(rows, part, "hf")
        for line in (x for x in hf if x.get("part") == "A"):
            ok, diff = ro.same_data(r, line)
            S["same_data"][key] = ok if ok else diff
        eng = _sf(sf, "engine")
        hf_params = next((x["params"] for x in hf if x.get("part") in ("B", "E_model")), None)
        if eng:
            S["params"][key] = {"shardfit": eng["params"], "hf": hf_params}
        ppo_out = "rl_lora_fwdbwd_vs_hf" if part == "lora-ppo" else "rl_fwdbwd_vs_hf"
        for what, hpart, out in (("fwd", "C", "rl_fwd_vs_hf"), ("ppo", "D" if part == "lora-ppo" else "E", ppo_out)):
            mine = _sf(sf, what)
            if mine is None or (part == "dense-fwd" and what == "ppo") or (part in ("dense-ppo", "lora-ppo")
                                                                           and what == "fwd"):
                continue
            best, default = _hf(hf, hpart), _hf(hf, hpart, "pad")
            if best:
                S.setdefault(out, {})[key] = round(mine["real_tok_s"] / best["real_tok_s"], 3)
                S[out + "_layout"] = {**S.get(out + "_layout", {}), key: best["layout"]}
            if default:
                S.setdefault(out + "_default", {})[key] = round(mine["real_tok_s"] / default["real_tok_s"], 3)
            every = _sf(sf, "fwd-all") if what == "fwd" else None  # --logprobs-at counted: the same, all scored
            if best and every:
                S.setdefault("rl_fwd_all_vs_hf", {})[key] = round(every["real_tok_s"] / best["real_tok_s"], 3)
    noac, mine = _hf(_get(rows, "lora-ppo", "hf-noac"), "D"), _sf(_get(rows, "lora-ppo", "shardfit"), "ppo")
    if noac and mine:  # against the anchor without gradient checkpointing (where it fits)
        S["rl_lora_fwdbwd_vs_hf_no_ac"] = {keys["lora-ppo"]: round(mine["real_tok_s"] / noac["real_tok_s"], 3)}
    moe = _get(rows, "moe", "shardfit")
    w = [x for x in moe if x.get(TAG) == "weights"]
    if w:
        S["weights_GBps"] = max(x["GBps"] for x in w)
    if ex := _sf(moe, "export"):
        S["export_hf_GBps"], S["export_hf_with_sync_GBps"] = ex["GBps"], ex["with_sync_GBps"]
    sdk = _sf(_get(rows, "serve", "sdk"), "sdk-ppo")
    inproc = _sf(_get(rows, "serve", "shardfit") or _get(rows, "lora-ppo" if a.serve_lora else "dense-ppo",
                                                         "shardfit"), "ppo")
    if sdk and inproc and (sdk["shape"], sdk.get("lora", 0)) == (inproc["shape"], inproc.get("lora", 0)):
        S["serve_vs_inprocess"] = round(sdk["step_s"] / inproc["step_s"], 4)
        m = sdk.get("metrics", {})  # the server's own view of the last step: queue wait, fwd/bwd, optimizer
        S["serve_step_s"] = {"shape": sdk["shape"], "lora": sdk.get("lora", 0), "sdk": sdk["step_s"],
                             "in_process": inproc["step_s"], "sdk_times": sdk.get("times_s"),
                             "in_process_times": inproc.get("times_s"),
                             **{k.split(":")[0]: round(v, 3) for k, v in m.items() if k.startswith("server_")}}
    fwd = _get(rows, "dense-fwd", "shardfit")
    variants = {x["variant"]: x["real_tok_s"] for x in fwd if x.get(TAG) == "fwd-variant"}
    if variants:
        S["fwd_variants_real_tok_s"] = variants  # Engine.forward now against session 14's settings, same process
    prof = {x["variant"]: x["table_ms"] for x in fwd if x.get(TAG) == "prof"}
    if prof:
        S["fwd_profile_ms"] = prof
    profiles(rows, r, a, S)
    return S


def _prof(lines: list[dict], kind: str) -> dict | None:
    return next((x for x in reversed(lines) if x.get(TAG) == kind and x.get("class_table_ms")), None)


def _side_by_side(sf: list[dict], hf: list[dict], kind: str) -> tuple[dict | None, dict | None, dict | None]:
    """Each side's last profile line of `kind` (shardfit's, the anchor's) and, where either has one, their class
    tables compared (rl_profile.compare) with each side's matmuls, profiled wall time and kernel counts."""
    mine, theirs = _prof(sf, kind), _prof(hf, kind)
    if not (mine or theirs):
        return mine, theirs, None
    m, t = mine or {}, theirs or {}
    return mine, theirs, {
        "table_ms [shardfit, anchor, anchor/shardfit]": rp.compare(m.get("class_table_ms", {}),
                                                                   t.get("class_table_ms", {})),
        **{key: {"shardfit": m.get(field), "anchor": t.get(field)}
           for key, field in (("gemm", "gemm"), ("profiled_wall_s", "wall_s"), ("kernels", "kernels"))}}


def _errors(S: dict, key: str, sf: list[dict], hf: list[dict], kind: str) -> None:
    """S[key]["errors"]: {side: error} of the profile lines of `kind` that failed (bench_rl_workers' guarded)."""
    errors = {side: x["error"] for side, lines in (("shardfit", sf), ("anchor", hf)) for x in lines
              if x.get(TAG) == kind and x.get("error")}
    if errors:
        S.setdefault(key, {})["errors"] = errors


def profiles(rows: list[dict], r: ro.Rollouts, a, S: dict) -> None:
    """--prof-out: the two sides' profiles kernel class by kernel class (rl_profile), into S and DIR/*_compare.json.
    ppo_profile: the 8B LoRA PPO step (lora-ppo); its bounds say how far 2x is (rl_profile.bounds) against the
    matmul ceiling measured in the shardfit worker; useful: the step's matmul and attention work by the model's
    sizes over the real tokens (rl_profile.dense_flops, the head over response rows only, 2 passes), per second of
    each side's unprofiled step; bounds.useful_*: the anchor's step over that work (with and without the blocks'
    recompute) at the ceiling, what no implementation of this step can beat. moe_fwd_profile: one forward of the
    MoE part, each side."""
    sf, hf = _get(rows, "lora-ppo", "shardfit"), _get(rows, "lora-ppo", "hf")
    mine, theirs, P = _side_by_side(sf, hf, "prof-ppo")
    if P:
        ppo, best, ceil = _sf(sf, "ppo"), _hf(hf, "D"), _sf(sf, "ceiling")
        P["ceiling"] = ceil and {k: ceil[k] for k in ("TFLOPs", "by_shape", "gpu")}
        if mine and ppo and best:
            P["bounds"] = rp.bounds({"table": mine["class_table_ms"], "gemm": mine["gemm"]},
                                    {"table": (theirs or {}).get("class_table_ms", {}),
                                     "gemm": (theirs or {}).get("gemm")},
                                    ppo["step_s"], best["step_s"], ceil and ceil["TFLOPs"])
        if a.fwd_shape == "8b":
            lens = [len(x) - 1 for x in r.seqs]  # a datum's positions
            use = rp.dense_flops(rp.QWEN3_8B, sum(lens), r.response_tokens, lora_rank=LORA_RANK, head_passes=2)
            att = 4.5 * rp.attention_flops(lens, 32, 128, 36) * 1e-12  # forward, recompute, backward (2.5x)
            use["attention_TFLOP"] = round(att, 1)
            for side, line, step in (("shardfit", mine, ppo), ("anchor", theirs, best)):
                if step:
                    use[f"{side}_useful_TFLOPs"] = round(use["total_TFLOP"] / step["step_s"], 1)
                t = (line or {}).get("class_table_ms", {})
                att_ms = t.get("attention: forward", 0) + t.get("attention: backward + recompute", 0)
                if att_ms:
                    use[f"{side}_attention_TFLOPs"] = round(att / att_ms * 1e3, 1)
            P["useful"] = use
            if best and ceil and P.get("bounds"):  # any step doing the model's own matmul work, at the ceiling
                bare = rp.dense_flops(rp.QWEN3_8B, sum(lens), r.response_tokens, lora_rank=LORA_RANK, head_passes=2,
                                      recompute=False)["total_TFLOP"]
                P["bounds"]["useful_at_ceiling_rest_free"] = round(best["step_s"] / (use["total_TFLOP"]
                                                                                     / ceil["TFLOPs"]), 3)
                P["bounds"]["useful_no_recompute_at_ceiling_rest_free"] = round(best["step_s"] / (bare
                                                                                                  / ceil["TFLOPs"]), 3)
        S["ppo_profile"] = P
    _errors(S, "ppo_profile", sf, hf, "prof-ppo")
    sf, hf = _get(rows, "moe", "shardfit"), _get(rows, "moe", "hf")
    _, _, M = _side_by_side(sf, hf, "prof")
    if M:
        if a.device == "cuda":
            lens = [len(x) - 1 for x in r.seqs]
            M["useful"] = rp.moe_forward_flops(rp.QWEN3_30B_A3B, a.moe_layers, sum(lens), r.response_tokens)
        S["moe_fwd_profile"] = M
    _errors(S, "moe_fwd_profile", sf, hf, "prof")


def table(rows: list[dict], S: dict) -> None:
    print(f"\n{'part':<10} {'system':<34} {'what':<16} {'real tok/s':>10} {'step s':>8} {'alloc/resv GiB':>15}")
    for row in rows:
        if "skipped" in row or row.get("error"):
            print(f"{row.get('part', ''):<10} {row['label'][:34]:<34} {row.get('skipped') or row.get('error')}"[:150])
        for x in row.get("lines", []):
            kind = x.get(TAG) or (x.get("part") in ("C", "D", "E") and f"{x['part']} {x.get('layout')}"
                                  + (" (profiled)" if x.get("tag") == "profiled" else ""))
            if kind == "fwd-variant":
                kind = f"fwd {x['variant']}"
            if kind and "real_tok_s" in x:
                mem = f"{x.get('peak_alloc_GiB', x.get('peak_alloc_gib', '-'))}/" \
                      f"{x.get('peak_reserved_GiB', x.get('peak_resv_gib', '-'))}"
                print(f"{row['part']:<10} {row['label'][:34]:<34} {kind:<16} {x['real_tok_s']:>10,} "
                      f"{x['step_s']:>8} {mem:>15}")
            elif x.get("oom") or x.get("skipped") or x.get("error"):
                print(f"{row['part']:<10} {row['label'][:34]:<34} {x.get('part')} {x.get('layout')}: "
                      f"{'OOM' if x.get('oom') else x.get('skipped') or x['error']}"[:200])
            elif kind in ("weights", "export"):
                print(f"{row['part']:<10} {row['label'][:34]:<34} {kind:<16} {x['GB']} GB at {x['GBps']} GB/s"
                      + (f" ({x['with_sync_GBps']} GB/s with os.sync)" if kind == "export" else ""))
    prof = S.get("fwd_profile_ms", {})
    if prof:  # the forward's GPU time, by where it went (bench_rl_profiling.PROF_ROWS), each variant a column
        names = list(prof)
        print(f"\n{'Engine.forward GPU time (ms)':<50}" + "".join(f"{n:>10}" for n in names))
        for row in prof[names[0]]:
            print(f"{row:<50}" + "".join(f"{prof[n].get(row, 0):>10.1f}" for n in names))
    for key, title in (("ppo_profile", "PPO step, 8B LoRA"), ("moe_fwd_profile", "MoE forward")):
        P = S.get(key)
        if not P:
            continue
        if P.get("errors"):
            print(f"\n{title}: profile errors {json.dumps(P['errors'])}")
        t = P.get("table_ms [shardfit, anchor, anchor/shardfit]", {})
        print(f"\n{title + ': GPU time (ms)':<46}{'shardfit':>10}{'anchor':>10}{'x':>7}")
        for row, (x, y, q) in t.items():
            print(f"{row:<46}{x:>10.1f}{y:>10.1f}{rp.fmt(q):>7}")
        for side, g in P.get("gemm", {}).items():
            if g:
                print(f"{side} matmuls: " + ", ".join(f"{c} {v['ms']:.0f} ms {v['TFLOP']:.1f} TFLOP "
                                                       f"{rp.fmt(v['TFLOPs'])} TFLOP/s"
                                                       for c, v in g.items() if v["ms"]))
        for k in ("bounds", "useful", "ceiling"):
            if P.get(k):
                print(f"{k}: {json.dumps(P[k])}")
    for k, v in S.items():  # the ratios first
        if v not in ({}, None) and k not in ("same_data", "params", "fwd_profile_ms", "ppo_profile",
                                             "moe_fwd_profile"):
            print(f"{k}: {json.dumps(v)}")
    print(f"same data as the anchor: {json.dumps(S['same_data'])}; parameters: {json.dumps(S['params'])}")
