"""Findings: what went wrong in the memory of one or several ranks, with the evidence and the change to make."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

from shardfit.doctor.cap import CapSettings, device_total, fraction_of
from shardfit.doctor.replay import Layout, Replay, phase_at

GiB, MiB = 1 << 30, 1 << 20
NO_CAP = CapSettings()  # the caller knows nothing about a per-process cap


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / MiB:.1f} MiB"


@dataclass
class Finding:
    code: str
    severity: str  # "error" (an OOM), "warning", "info"
    title: str
    evidence: list[str] = field(default_factory=list)
    fix: list[str] = field(default_factory=list)
    rank: int | None = None
    figures: dict = field(default_factory=dict)  # the numbers behind the evidence, per code (see report.py)


@dataclass
class RankResult:
    rank: int
    replay: Replay
    memory_fraction: float | None = None  # the per-process cap's fraction, when known (doctor/cap.py)
    memory_fraction_source: str | None = None

    @property
    def path(self) -> str:
        return self.replay.snapshot.path


def rank_of(path: str, fallback: int) -> int:
    m = re.search(r"rank[_-]?(\d+)", path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else fallback


def _uses_fsdp1(r: Replay) -> bool:
    frames = [f for stack in r.snapshot.stacks() for f in stack[:30]]
    frames += [f for s in r.snapshot.segments for b in s["blocks"] for f in b.get("frames", [])[:30]]
    return any("_flat_param.py" in f.get("filename", "") or "fully_sharded_data_parallel.py" in f.get("filename", "")
               for f in frames)


def fragmentation(rank: int, r: Replay) -> list[Finding]:
    p = r.peak
    unused = p.reserved - p.allocated - p.pending_free
    if p.reserved == 0 or unused < 256 * MiB or unused / p.reserved < 0.2:
        return []
    fig = {"allocated": p.allocated, "reserved": p.reserved, "pending_free": p.pending_free, "unused": unused,
           "unused_fraction": unused / p.reserved, "free_in_split_segments": p.free_in_split_segments,
           "largest_free": p.largest_free, "peak_reserved": r.peak_reserved,
           "expandable_segments": r.snapshot.expandable}
    evidence = [f"at the allocated peak ({gib(p.allocated)}) the cache reserved {gib(p.reserved)}: {gib(unused)} "
                f"({unused / p.reserved:.0%}) reserved but unused",
                f"{gib(p.free_in_split_segments)} of it is free space inside segments that also hold live tensors "
                "(split blocks: the cache cannot release them, and requests bigger than each hole cannot use them)",
                f"largest free block {gib(p.largest_free)}; peak reserved over the whole trace {gib(r.peak_reserved)}"]
    if r.snapshot.expandable:
        return [Finding("fragmentation", "warning", "fragmentation even with expandable segments", evidence,
                        ["vary tensor shapes less (bucket sequence lengths, fixed micro-batch size)",
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8"], rank,
                        fig)]
    return [Finding("fragmentation", "warning",
                    f"fragmentation: {unused / p.reserved:.0%} of reserved memory unused at the peak", evidence,
                    ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place and freed pages are "
                     "reused for any size; shardfit train sets it by default)",
                     "or keep shapes steady: pad sequences to a few bucket lengths"], rank, fig)]


def pending_free(rank: int, r: Replay) -> list[Finding]:
    worst: Layout = max((r.peak, r.end), key=lambda lay: lay.pending_free)
    if worst.pending_free < max(64 * MiB, 0.05 * worst.reserved):
        return []
    when = "at dump time" if worst is r.end else "at the peak"
    live = worst.allocated
    fig = {"when": "dump" if worst is r.end else "peak", "pending_free": worst.pending_free,
           "pending_blocks": worst.pending_blocks, "allocated": live, "reserved": worst.reserved}
    return [Finding("pending_free", "warning",
                    f"{gib(worst.pending_free)} held for other streams (record_stream) {when}",
                    [f"{worst.pending_blocks} blocks freed by Python are still 'active_pending_free': another stream "
                     "was still using them, so the cache may not reuse them and new requests take fresh memory",
                     f"reserved {gib(worst.reserved)} for {gib(live)} of live tensors "
                     f"({worst.reserved / max(live, 1):.1f}x)"],
                    ["free memory on the stream that used it, or keep the tensor alive until an event recorded on "
                     "that stream has completed, instead of tensor.record_stream()",
                     "torch < 2.8 with NCCL collectives: TORCH_NCCL_AVOID_RECORD_STREAMS=1",
                     "FSDP2: leave _set_unshard_async_op off with explicit prefetch (it goes through c10d's "
                     "record_stream)"], rank, fig)]


def segment_request(asked: int) -> int:
    """What the allocator asks the driver for a request that no cached block holds (c10 CUDACachingAllocator: up to
    1 MiB from a 2 MiB small segment, up to 10 MiB from a 20 MiB one, else rounded up to 2 MiB)."""
    if asked <= MiB:
        return 2 * MiB
    if asked < 10 * MiB:
        return 20 * MiB
    return -(-asked // (2 * MiB)) * 2 * MiB


def oom_figures(r: Replay, ev: dict, lay: Layout, given: CapSettings) -> dict:
    """The numbers behind one OOM, and which single change would have let the request through.

    releasable: free bytes in segments that hold nothing (c10 releases them and retries before it reports an OOM, so
    at a real OOM this is ~0). headroom: how far the cache could still grow: the driver's free memory plus the
    releasable bytes, and with a per-process cap at most cap - (reserved - releasable) (c10 refuses
    `reserved + size > cap` before asking the driver). A request fits with expandable segments when the split holes
    (free bytes in segments that also hold live tensors) plus the headroom cover it, once pending frees complete when
    pending + headroom do, without the cap when driver-free + releasable do."""
    asked, stream = ev.get("size", 0), ev.get("stream", 0)
    device_free = ev.get("device_free", ev.get("addr", 0))
    st = lay.per_stream.get(stream, {})
    fraction, fraction_source = fraction_of(r.snapshot, given)
    releasable = lay.free_in_segments - lay.free_in_split_segments
    fig = {"asked": asked, "stream": stream, "stream_largest_free": st.get("largest_free", 0),
           "stream_free": st.get("free", 0), "largest_free": lay.largest_free, "free_in_segments": lay.free_in_segments,
           "free_in_split_segments": lay.free_in_split_segments, "releasable": releasable,
           "pending_free": lay.pending_free, "pending_blocks": lay.pending_blocks, "allocated": lay.allocated,
           "reserved": lay.reserved, "categories": dict(lay.categories), "device_free": device_free,
           "memory_fraction": fraction, "memory_fraction_source": fraction_source,
           "device_total": None, "device_total_source": None, "memory_cap": None, "headroom": device_free + releasable}
    if fraction is not None:
        total, total_source = device_total(r.snapshot, given, lay.reserved, device_free)
        cap = int(fraction * total)
        fig.update(device_total=total, device_total_source=total_source, memory_cap=cap,
                   headroom=max(0, min(device_free + releasable, cap - (lay.reserved - releasable))))
    head, split, pend, request = fig["headroom"], lay.free_in_split_segments, lay.pending_free, segment_request(asked)
    fig["would_fit"] = {
        "expandable_segments": not r.snapshot.expandable and split + head >= asked,
        "pending_completed": pend > 0 and pend + head >= asked,
        "expandable_segments_and_pending_completed": not r.snapshot.expandable and split + pend + head >= asked,
        "no_memory_cap": fraction is not None and device_free + releasable >= request > head}
    fits = fig["would_fit"]
    # The cache could have grown by a fresh segment for the request: c10 would have got it, so something the figures
    # do not show refused it: without a known cap most likely set_per_process_memory_fraction (snapshots do not
    # record it; the would_fit answers then assume no cap), with one another process taking memory meanwhile.
    unexplained = head >= request
    fig["cause"] = ("unrecorded_memory_cap" if unexplained and fraction is None else "unexplained" if unexplained
                    else "fragmentation" if fits["expandable_segments"]
                    else "pending_free" if fits["pending_completed"]
                    else "fragmentation_and_pending_free" if fits["expandable_segments_and_pending_completed"]
                    else "memory_cap" if fits["no_memory_cap"] else "capacity")
    return fig


def _oom_advice(f: dict) -> tuple[str, list[str]]:
    """(verdict, fix) for one OOM's figures."""
    asked, split, pend = gib(f["asked"]), gib(f["free_in_split_segments"]), gib(f["pending_free"])
    capped = f["memory_cap"] is not None and f["memory_fraction"] < 1  # a fraction of 1 is no cap
    room = gib(f["headroom"]) + (" the cap allowed" if capped else " free on the device")
    cause = f["cause"]
    if cause == "fragmentation":
        return "fragmentation: the bytes were there, but not in one block", [
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would have let this request through: "
            f"{split} free in split segments + {room} >= {asked}"]
    if cause == "pending_free":
        return "memory held for another stream", [
            "see the record_stream finding: free on the using stream or wait on an event"]
    if cause == "fragmentation_and_pending_free":
        return "fragmentation and memory held for another stream", [
            f"expandable_segments:True and no record_stream together: {split} in split segments + {pend} pending + "
            f"{room} >= {asked}"]
    if cause == "memory_cap":
        need = (f["reserved"] - f["releasable"] + segment_request(f["asked"])) / f["device_total"]
        return "the per-process memory cap refused it", [
            f"raise the fraction given to torch.cuda.set_per_process_memory_fraction to at least {need:.3f}, or remove "
            f"it: the device had {gib(f['device_free'])} free"]
    if cause == "unrecorded_memory_cap":
        return "the device had room: a limit the snapshot does not record refused it", [
            f"the cache could have grown by {room}, enough for {asked}: most likely "
            "torch.cuda.set_per_process_memory_fraction, which snapshots do not record; rerun the doctor with "
            "--memory-fraction to check"]
    if cause == "unexplained":
        return "the figures say it should have fit (another process took memory meanwhile?)", [
            f"the cache could have grown by {room} >= {asked}: check other processes on this GPU (nvidia-smi)"]
    return "too many live tensors for this GPU", [
        "lower the micro-batch or the sequence length",
        "enable activation checkpointing (--compute.activation_checkpoint=selective or full)", "shard over more GPUs"]


def oom(rank: int, r: Replay, given: CapSettings) -> list[Finding]:
    out = []
    for ev, lay in r.ooms:
        f = oom_figures(r, ev, lay, given)
        asked, cap = f["asked"], f["memory_cap"]
        # Written from the figures only, so that the JSON holds every number the sentences quote
        evidence = [f"asked {gib(asked)} on stream {f['stream']}; largest free block in that stream "
                    f"{gib(f['stream_largest_free'])}, free inside its segments {gib(f['stream_free'])}, free in all "
                    f"segments {gib(f['free_in_segments'])} (in split segments {gib(f['free_in_split_segments'])})",
                    f"live tensors {gib(f['allocated'])}, reserved {gib(f['reserved'])}, pending free "
                    f"{gib(f['pending_free'])}, driver reported {gib(f['device_free'])} free on the device",
                    "live memory: " + ", ".join(f"{k} {gib(v)}" for k, v in list(f["categories"].items())[:5])]
        if cap is not None:
            estimated = ", estimated" if f["device_total_source"] == "estimate" else ""
            evidence.append(f"per-process memory cap {gib(cap)} (fraction {f['memory_fraction']:g} of "
                            f"{gib(f['device_total'])}{estimated}; fraction from {f['memory_fraction_source']}): "
                            f"the cache could grow by {gib(f['headroom'])} more")
        verdict, fix = _oom_advice(f)
        out.append(Finding("oom", "error", f"out of memory asking {gib(asked)}: {verdict}", evidence, fix, rank, f))
    return out


def side_stream_cache(rank: int, r: Replay) -> list[Finding]:
    """Free memory cached by streams other than the busiest one at the peak. The caching allocator keeps one pool per
    stream: what a side stream (FSDP's all-gather or reduce-scatter stream, a prefetch stream) freed can be reused by
    that stream only, so at the compute stream's peak it is reserved and idle."""
    p = r.peak
    if not p.per_stream or p.reserved == 0:
        return []
    main = max(p.per_stream, key=lambda s: p.per_stream[s]["allocated"])
    idle = {s: st["free"] for s, st in p.per_stream.items() if s != main and st["free"] > 0}
    total = sum(idle.values())
    if total < max(1 * GiB, 0.05 * p.reserved):
        return []
    fig = {"compute_stream": main, "compute_allocated": p.per_stream[main]["allocated"], "idle": total,
           "idle_fraction": total / p.reserved, "reserved": p.reserved,
           "streams": [{"stream": s, "reserved": p.per_stream[s]["reserved"], "free": free}
                       for s, free in sorted(idle.items(), key=lambda kv: -kv[1])]}
    evidence = [f"at the peak the compute stream ({main}) holds {gib(fig['compute_allocated'])} of tensors; "
                f"{gib(total)} more is reserved by other streams with nothing in it "
                f"({total / p.reserved:.0%} of reserved)"]
    evidence += [f"stream {x['stream']}: reserved {gib(x['reserved'])}, free {gib(x['free'])}"
                 for x in fig["streams"][:3]]
    return [Finding("side_stream_cache", "warning", f"{gib(total)} cached by side streams at the peak", evidence,
                    ["FSDP2: the reduce-scatter outputs become the sharded gradients, allocated in that stream's "
                     "pool; zero_grad(set_to_none=True) frees them into it before the next forward, where the compute "
                     "stream cannot use them. Keep gradients allocated with zero_grad(set_to_none=False) (shardfit: "
                     "memory.keep_grads=true, the default)",
                     "allocate long-lived buffers on the stream that uses them, or release a side stream's cache "
                     "with torch.cuda.empty_cache() after its work (costs a re-allocation)"], rank, fig)]


def single(rank: int, r: Replay, given: CapSettings = NO_CAP) -> list[Finding]:
    return oom(rank, r, given) + pending_free(rank, r) + side_stream_cache(rank, r) + fragmentation(rank, r)


def across_ranks(results: list[RankResult]) -> list[Finding]:
    if len(results) < 2:
        return []
    peaks = {x.rank: x.replay.peak.allocated for x in results}
    hi, lo = max(peaks.values()), min(peaks.values())
    ranked = sorted(results, key=lambda x: x.rank)
    per_rank = [{"rank": x.rank, "peak_allocated": x.replay.peak.allocated, "peak_reserved": x.replay.peak_reserved}
                for x in ranked]
    if lo > 0 and hi / lo <= 1.10:
        return [Finding("balanced", "info", f"ranks balanced: peak allocated within {hi / lo - 1:.1%} "
                        f"({gib(lo)} to {gib(hi)})", figures={"peaks": per_rank, "min": lo, "max": hi,
                                                               "spread": hi / lo - 1})]
    med = statistics.median(peaks.values())
    if len(results) == 2:
        outlier = min(peaks, key=peaks.get)
    else:
        outlier = max(peaks, key=lambda k: abs(peaks[k] - med))
    out_r = next(x for x in results if x.rank == outlier)
    others = [x for x in results if x.rank != outlier]
    cats = set(out_r.replay.peak.categories) | {c for x in others for c in x.replay.peak.categories}
    # Medians of an even count are halves: rounded down, so every size in the figures stays a whole byte count
    diffs = {c: out_r.replay.peak.categories.get(c, 0) - int(statistics.median(
        [x.replay.peak.categories.get(c, 0) for x in others])) for c in cats}
    cat = max(diffs, key=lambda c: abs(diffs[c]))
    ref = int(statistics.median([peaks[x.rank] for x in others]))
    evidence = ["peak allocated per rank: " + ", ".join(f"rank {k} {gib(v)}" for k, v in sorted(peaks.items())),
                f"rank {outlier} holds {peaks[outlier] / max(ref, 1):.0%} of the others' median; the category that "
                f"differs most at the peak is {cat} ({'+' if diffs[cat] > 0 else ''}{gib(diffs[cat])} "
                f"on rank {outlier})"]
    fix = ["every rank should hold the same shards: build on meta, shard, then materialise or load on every rank"]
    title = f"rank {outlier} holds {peaks[outlier] / max(ref, 1):.0%} of the other ranks' memory ({cat} differ)"
    if cat == "parameters" and diffs[cat] < 0 and any(_uses_fsdp1(x.replay) for x in results):
        title = (f"rank {outlier} holds {peaks[outlier] / max(ref, 1):.0%} of the others' memory: its parameters "
                 "never reached its GPU (FSDP1 meta-device init without sync_module_states)")
        fix = ["FSDP1: pass sync_module_states=True and device_id=torch.cuda.current_device() so rank 0's weights "
               "are broadcast to every rank", "or use FSDP2 with meta-device init (shardfit train does)"]
    for p, x in zip(per_rank, ranked):  # the differing category's bytes at each rank's peak
        p["category_bytes"] = x.replay.peak.categories.get(cat, 0)
    fig = {"peaks": per_rank, "outlier_rank": outlier, "others_median": ref, "ratio": peaks[outlier] / max(ref, 1),
           "category": cat, "category_difference": diffs[cat],
           "categories": {c: out_r.replay.peak.categories.get(c, 0) for c in sorted(cats)}}
    return [Finding("imbalance", "warning", title, evidence, fix, outlier, fig)]


def fsdp_buffers(results: list[RankResult]) -> list[Finding]:
    r = results[0].replay
    ag, rs = r.category_max.get("fsdp_all_gather", 0), r.category_max.get("fsdp_reduce_scatter", 0)
    if not (ag or rs):
        return []
    return [Finding("fsdp_buffers", "info", f"FSDP2 communication buffers: all-gather up to {gib(ag)}, "
                    f"reduce-scatter up to {gib(rs)} live at once (rank {results[0].rank})",
                    figures={"all_gather": ag, "reduce_scatter": rs, "rank": results[0].rank})]


def diagnose(results: list[RankResult], given: CapSettings = NO_CAP) -> list[Finding]:
    findings = [f for x in results for f in single(x.rank, x.replay, given)]
    findings += across_ranks(results) + fsdp_buffers(results)
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order[f.severity])


def peak_phase(r: Replay) -> str | None:
    if not r.times or r.peak_index < 0:
        return None
    return phase_at(r.snapshot, r.times[r.peak_index])
