"""Ready-made configs for common situations: TOML files shipped in this directory, `--config recipe:NAME`.

A recipe is an ordinary config file plus a `[recipe]` table the loader skips:

  [recipe]
  description = "one line for `shardfit recipes`"
  layouts = [[8, 79]]       # [GPUs, GiB each] it was planned for (`shardfit plan --nproc 8 --gpu-memory 79`), in
                            # GiB as torch reports them (79 for an 80 GB GPU, 139 for a 141 GB one)
  measured = "..."          # the benchmarks/ files that hold its figures (a test finds them there), or ""
  [recipe.needs]            # keys the user must give, with what to give; `shardfit train` refuses to start without
  "model.path" = "a Llama-3-8B Hugging Face directory"

Recipes name the model by preset (`model.name`) too, so that `shardfit plan --config recipe:NAME` works without
the weights; `--model.path` then takes the architecture from the checkpoint's config.json. A copy of a recipe,
edited, is a config file like any other.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shardfit.errors import ShardfitError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

DIR = Path(__file__).resolve().parent
PREFIX = "recipe:"


@dataclass
class Recipe:
    name: str
    path: Path
    description: str
    layouts: list[tuple[int, float]]
    measured: str = ""
    needs: dict[str, str] = field(default_factory=dict)


def names() -> list[str]:
    return sorted(p.stem for p in DIR.glob("*.toml"))


def resolve(spec: str) -> Path:
    """`recipe:NAME` -> the shipped file; anything else is a path, returned as given."""
    if not spec.startswith(PREFIX):
        return Path(spec)
    name = spec[len(PREFIX):]
    path = DIR / f"{name}.toml"
    if not path.is_file():
        close = difflib.get_close_matches(name, names(), n=3, cutoff=0.4)
        raise ShardfitError(f"unknown recipe '{name}'", where="--config",
                            fix=(f"did you mean {' or '.join(PREFIX + c for c in close)}? " if close else "")
                            + "see `shardfit recipes`")
    return path


def read(spec: str) -> Recipe | None:
    """The [recipe] table of a recipe name or a config file; None when the file has none (a plain config)."""
    path = resolve(spec)
    try:
        meta = tomllib.loads(path.read_text(encoding="utf-8")).get("recipe")
    except (OSError, tomllib.TOMLDecodeError):
        return None  # the loader reports unreadable files with their reason
    if not isinstance(meta, dict):
        return None
    try:
        return Recipe(path.stem, path, str(meta["description"]),
                      [(int(n), float(gib)) for n, gib in meta["layouts"]], str(meta.get("measured", "")),
                      {str(k): str(v) for k, v in meta.get("needs", {}).items()})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ShardfitError(f"[recipe] table is incomplete ({e!r})", where=str(path),
                            fix="give description and layouts = [[GPUS, GIB], ...]") from None


def check_needs(recipe: Recipe, cfg) -> None:
    """Before training: every key the recipe needs is set (a fine-tuning recipe without weights would otherwise
    train a randomly initialised model)."""
    from shardfit.config.schema import Config

    default = Config()
    for key, what in recipe.needs.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if not value or value == getattr(getattr(default, section), name):  # e.g. data.tokenizer left at "byte"
            raise ShardfitError(f"recipe '{recipe.name}' needs {key}", where=str(recipe.path),
                                fix=f"add --{key}=... ({what})")


def listing() -> str:
    """The table `shardfit recipes` prints."""
    rows = [read(f"{PREFIX}{n}") for n in names()]
    width = max(len(r.name) for r in rows)
    lines = []
    for r in rows:
        gpus = ", ".join(f"{n} x {gib:.0f} GiB" for n, gib in r.layouts)
        lines += [f"{r.name:{width}}  {r.description}", f"{'':{width}}  planned for: {gpus}"]
        if r.needs:
            lines.append(f"{'':{width}}  needs: " + ", ".join(f"--{k} ({v})" for k, v in r.needs.items()))
        lines.append(f"{'':{width}}  measured: {r.measured or 'not yet (planned only)'}")
    lines += ["", f"use:   shardfit train --config {PREFIX}NAME [--section.key=value ...]",
              f"check: shardfit plan --config {PREFIX}NAME --nproc GPUS --gpu-memory GIB",
              f"files: {DIR} (copy one to edit it)"]
    return "\n".join(lines)
