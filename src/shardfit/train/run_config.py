"""Which run a config belongs to: the default run directory, and whether a saved run may continue under it.

Every key is in one of three groups (`group`):
  - compatible: how and where the run computes, logs and saves ([parallel], [compute], [checkpoint], [logging],
    [memory], [serve], and COMPATIBLE below): a resumed run may change them freely (DCP reshards for another layout);
  - schedule (SCHEDULE): the learning-rate schedule and AdamW's settings; a change re-stretches the schedule from the
    step resumed, so it is refused unless named in checkpoint.allow_changes (train.steps brings the warm-up, which
    follows it by default), and then said in one line;
  - experiment: everything else ([model], [data], the batch, the seed): what is trained, on what. A change is
    refused unless named in checkpoint.allow_changes.
A resumed run is compared with the config saved in the checkpoint it resumes; a new run with the config.toml a
run that trained left in the run directory. The default run directory is runs/<model.name>-<8 hex digits>: a hash of
the experiment and schedule keys that differ from the schema's defaults, so the same command finds (and resumes) its
own run, another experiment gets another directory, and a key added to shardfit at its default moves no run.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from shardfit.config import Config, config_to_dict
from shardfit.errors import ShardfitError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

COMPATIBLE_SECTIONS = ("parallel", "compute", "checkpoint", "logging", "memory", "serve")
COMPATIBLE = {"data.val_path", "train.micro_batch", "train.eval_every", "train.eval_batches",
              "train.max_skipped_steps", "train.watchdog_s", "train.device"}
SCHEDULE = ("train.steps", "train.epochs", "train.lr", "train.min_lr_ratio", "train.warmup_steps",
            "train.weight_decay", "train.beta1", "train.beta2", "train.eps", "train.grad_clip")
RESOLVED = {"train.epochs"}  # named in the hash; not compared: saved as 0, the train.steps it gave is compared
_SHOWN = 4  # differing keys named in the refusal


def group(key: str) -> str:
    """'compatible', 'schedule' or 'experiment' (see the module docstring)."""
    if key.split(".", 1)[0] in COMPATIBLE_SECTIONS or key in COMPATIBLE:
        return "compatible"
    return "schedule" if key in SCHEDULE else "experiment"


def flat(tree: dict) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, table in tree.items() if isinstance(table, dict) for k, v in table.items()}


def defining_keys(cfg: Config) -> dict[str, Any]:
    """The experiment and schedule keys with their values."""
    return {k: v for k, v in flat(config_to_dict(cfg)).items() if group(k) != "compatible"}


def run_hash(cfg: Config) -> str:
    defaults = defining_keys(Config())
    changed = {k: v for k, v in defining_keys(cfg).items() if k not in defaults or defaults[k] != v}
    return hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]


def default_run_dir(cfg: Config, kind: str = "") -> Path:
    """runs/<model>-<hash of the keys that define the run>; kind (e.g. "serve") prefixes the name, so that a server
    and a training run of one config keep their files (API key, Tinker checkpoints; checkpoints, logs) apart."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", cfg.model.name)
    return Path("runs") / f"{kind + '-' if kind else ''}{name}-{run_hash(cfg)}"


def read_toml(path: Path) -> dict:
    """A config.toml, parsed; one line if it is unreadable."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ShardfitError(f"cannot read the recorded config ({e})", where=str(path),
                            fix="restore it, or give this run its own logging.run_dir") from None


def allowed_keys(cfg: Config) -> set[str]:
    """checkpoint.allow_changes as a set of keys, each checked against the schema."""
    known = set(flat(config_to_dict(Config())))
    keys = {k.strip() for k in cfg.checkpoint.allow_changes.split(",") if k.strip()}
    for key in sorted(keys - known):
        import difflib

        close = difflib.get_close_matches(key, sorted(known), n=1)
        raise ShardfitError(f"'{key}' is not a config key", where="checkpoint.allow_changes",
                            fix=f"did you mean '{close[0]}'?" if close else "name keys as section.key, e.g. "
                            "train.steps")
    return keys


def differences(saved: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) of the experiment and schedule keys that differ; a key the saved config does
    not have (an older shardfit's) is not compared."""
    old = flat(saved)
    return [(k, old[k], v) for k, v in defining_keys(cfg).items() if k in old and old[k] != v and k not in RESOLVED]


def _show(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, str) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def check_config(cfg: Config, saved: dict | None, source: Path | None, step: int, init_hint: str | None
                 ) -> list[str]:
    """Raise (one line: the differing keys and both fixes) unless this run may continue the saved one; else the
    notices of the changes allowed. source: the saved config's file (a checkpoint's or the run directory's); step:
    the step resumed (0: a new run); init_hint: the checkpoint a new run could start from (model.init_from)."""
    if saved is None:
        return []
    given = allowed_keys(cfg)
    steps = given & {"train.steps", "train.epochs"}  # the steps (or the epochs that give them) bring the warm-up
    allowed = given | ({"train.steps", "train.warmup_steps"} if steps else set())
    diffs = differences(saved, cfg)
    refused = [d for d in diffs if d[0] not in allowed]
    what = f"the checkpoint of step {step}" if step else "the run recorded in this directory"
    via = f" (train.epochs={cfg.train.epochs:g})" if cfg.train.epochs else ""
    if refused:
        listed = ", ".join(f"{k} {_show(a)} -> {_show(b)}{via if k == 'train.steps' else ''}"
                           for k, a, b in refused[:_SHOWN])
        more = f" and {len(refused) - _SHOWN} more" if len(refused) > _SHOWN else ""
        named = {"train.epochs" if k == "train.steps" and via else k for k, _, _ in refused}
        if named & {"train.steps", "train.epochs"}:
            named.discard("train.warmup_steps")  # follows them
        start = f"; --model.init_from={init_hint} starts it from these weights" if init_hint else ""
        raise ShardfitError(f"this config differs from {what} in {listed}{more}", where=str(source),
                            fix=f"start a new run in its own directory (leave logging.run_dir empty: each "
                            f"experiment gets one{start}), or continue this run with the change: "
                            f"--checkpoint.allow_changes={','.join(sorted(given | named))}")
    if not diffs:
        return []
    listed = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in diffs)
    notice = f"continuing {what} with {listed} (checkpoint.allow_changes)"
    if step and any(group(k) == "schedule" for k, _, _ in diffs):
        notice += schedule_change(saved, cfg, step)
    return [notice]


def schedule_change(saved: dict, cfg: Config, step: int) -> str:
    """The learning rate of the next step under the saved schedule and under the new one."""
    from shardfit.config.schema import TrainConfig
    from shardfit.engine.optim import lr_at

    fields = TrainConfig.__dataclass_fields__
    old = TrainConfig(**{k: v for k, v in (saved.get("train") or {}).items() if k in fields})
    return (f": the schedule is recomputed for train.steps={cfg.train.steps}, step {step + 1} runs at learning rate "
            f"{lr_at(step, cfg.train):.3g} ({lr_at(step, old):.3g} under the saved schedule)")


def saved_config(resume: Path | None, run_dir: Path) -> tuple[dict | None, Path | None]:
    """The config this run must match: the resumed checkpoint's, else the one a run that trained left in the run
    directory, else none."""
    source = resume / "config.toml" if resume is not None else run_dir / "config.toml"
    if not source.is_file():
        return None, None
    return read_toml(source), source


def sibling_hint(cfg: Config, run_dir: Path) -> str | None:
    """A new run from scratch in a default directory, while other runs of this model have checkpoints: say how to
    start from one of them (the issue's pretraining-then-fine-tuning, in separate directories)."""
    if cfg.model.path or cfg.model.init_from or not run_dir.parent.is_dir():
        return None
    prefix = run_dir.name.rsplit("-", 1)[0] + "-"
    others = sorted(p for p in run_dir.parent.iterdir() if p.name.startswith(prefix) and p != run_dir
                    and (p / "checkpoints").is_dir() and any((p / "checkpoints").glob("step_*/complete.json")))
    if not others:
        return None
    return (f"a new run from scratch in {run_dir}; {', '.join(map(str, others[:3]))} "
            f"{'holds' if len(others) == 1 else 'hold'} other runs of this model: --model.init_from=DIR starts from "
            "one's weights")
