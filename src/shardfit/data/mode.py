"""Which mode data.path's data trains in: fine-tuning examples (sft) or pretraining text, data.mode=auto read from the
files' first records. One answer for the data loader (build.py) and the config's training defaults (config/defaults.py
asks it through the root package: config may not import data). Torch-free: the config loader's process asks it.
"""

from __future__ import annotations

from shardfit.data.formats import is_sft_file
from shardfit.data.sources import resolve_files


def holds_examples(data_cfg) -> bool:
    """data.mode resolved: True for fine-tuning examples, False for pretraining text. auto goes by data.format when it
    names a layout, else by every file's first record (no data.path: the embedded text corpus). A file that cannot be
    read raises its one line (ShardfitError)."""
    if data_cfg.mode != "auto":
        return data_cfg.mode == "sft"
    if data_cfg.format != "auto":
        return data_cfg.format != "text"
    if not data_cfg.path:
        return False
    return all(is_sft_file(f, data_cfg.file_format) for f in resolve_files(data_cfg.path))
