"""What an allocation is, judged from the Python stack that made it (innermost frame first)."""

from __future__ import annotations

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "fsdp_all_gather", "fsdp_reduce_scatter",
              "logits_loss", "other", "unknown")

_PARAM_NAMES = {"to_empty", "_apply", "reset_parameters", "init_weights", "load_state_dict", "from_pretrained",
                "_init_sharded_param", "_init_param_handle_from_params", "flatten_tensors", "_get_shard",
                "set_model_state_dict", "_load_from_state_dict", "materialize", "_init_flat_param_and_metadata"}
_LOSS_NAMES = {"cross_entropy", "nll_loss", "log_softmax", "fused_linear_cross_entropy", "lm_head", "loss_function"}
_BACKWARD_NAMES = {"backward", "_engine_run_backward", "run_backward", "_backward"}


def categorize(frames: list[dict]) -> str:
    if not frames:
        return "unknown"  # allocated before recording began, or recorded without stacks
    names = [f.get("name", "") for f in frames]
    files = [f.get("filename", "") for f in frames]
    fsdp = any("fsdp" in f for f in files)
    if fsdp and any("reduce" in n for n in names):
        return "fsdp_reduce_scatter"
    if fsdp and any("all_gather" in n or n in ("unshard", "alloc_storage", "_init_unsharded_param") for n in names):
        return "fsdp_all_gather"
    if any("torch/optim/" in f for f in files):
        return "optimizer_state"
    if any(n in _PARAM_NAMES for n in names) or any("_flat_param.py" in f for f in files):
        return "parameters"
    if any(n in _LOSS_NAMES for n in names) or any(n.endswith("_loss") for n in names):
        return "logits_loss"
    if any(n in _BACKWARD_NAMES for n in names):
        return "gradients"
    if any("torch/nn/modules/" in f or n == "forward" for n, f in zip(names, files)):
        return "activations"
    return "other"


def site(frames: list[dict]) -> str:
    """The innermost frame outside PyTorch itself: where the user's code asked for the memory."""
    for f in frames:
        fn = f.get("filename", "")
        if not (fn.startswith("torch/") or "/torch/" in fn or fn.startswith("<")):
            return f"{fn}:{f.get('line', '?')} {f.get('name', '')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '')}"
    return "(no stack: allocated before recording)"
