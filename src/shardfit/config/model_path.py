"""model.path as users write it: a local directory, or a Hugging Face Hub id (`Qwen/Qwen3-8B`) already downloaded.

shardfit never downloads (training nodes often have no network, and a 140 GB download is not a side effect anyone
wants from `train`): a Hub id is looked up in the local Hugging Face cache, where `huggingface-cli download` or any
`from_pretrained` call left it (`<cache>/models--ORG--NAME/snapshots/<revision>/`, the revision that `refs/main`
names, else the newest snapshot holding a config.json). The cache is HF_HUB_CACHE, else HF_HOME/hub, else
XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub, as huggingface_hub resolves it. An id in no cache is
one error line with the download command.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shardfit.errors import ShardfitError

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def hub_caches() -> list[Path]:
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]) / "hub"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    return [Path(xdg) / "huggingface" / "hub" if xdg else Path.home() / ".cache" / "huggingface" / "hub"]


def cached_snapshot(hub_id: str) -> Path | None:
    """The local snapshot directory of a Hub model id, or None."""
    for cache in hub_caches():
        repo = cache / ("models--" + hub_id.replace("/", "--"))
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            pinned = snapshots / ref.read_text(encoding="utf-8").strip()
            if (pinned / "config.json").is_file():
                return pinned
        found = [s for s in snapshots.iterdir() if (s / "config.json").is_file()]
        if found:
            return max(found, key=lambda s: s.stat().st_mtime)
    return None


def resolve_model_path(path: str) -> str:
    """A local directory as given; a Hub id as its cached snapshot; otherwise one error line."""
    if Path(path).is_dir() or not _HUB_ID.fullmatch(path) or Path(path).exists():
        return path  # a directory, or a path whose problem the model reader names (not a directory, no config)
    snapshot = cached_snapshot(path)
    if snapshot is not None:
        return str(snapshot)
    caches = ", ".join(str(c) for c in hub_caches())
    raise ShardfitError(f"model directory not found, and '{path}' (a Hugging Face Hub id?) is not in the local "
                        f"cache ({caches}); shardfit does not download", where="model.path",
                        fix=f"download it first: huggingface-cli download {path} (then run again with the same "
                            "--model.path), or give a local directory")
