"""Build a `Config` from a TOML file plus `--section.key=value` overrides, check it, and write it back out.

Precedence, lowest first: dataclass defaults, the preset named by `model.name` (or `model.path`'s config.json) and
the training defaults of that model's size (schema.SIZE_DEFAULTS), the TOML file, CLI overrides. `--config` also takes
`recipe:NAME`, a TOML file shipped in shardfit/config/recipes. Every error names the file or flag, the key, and the
closest valid key or the accepted values.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import operator
import re
import sys
from pathlib import Path
from typing import Any

from shardfit.config.defaults import _apply_training_defaults, defaults_table, training_defaults
from shardfit.config.init_from import apply_init_from
from shardfit.config.lora_rules import LORA_RULES, AdapterReader, adapter_base, adapter_fields, nested_section
from shardfit.config.model_path import resolve_model_path
from shardfit.config.options import parse_overrides
from shardfit.config.preference_rules import PREFERENCE_RULES
from shardfit.config.schema import PRESETS, Config
from shardfit.config.spellings import Spellings, announce, did_you_mean, unknown_key_fix
from shardfit.errors import ShardfitError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

INT64 = (-(1 << 63), (1 << 63) - 1)
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_KIND = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string"}


def _sections(cfg: Config) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _fields(section: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section)}


def _coerce(value: Any, ftype: str, where: str, from_text: bool) -> Any:
    """Turn a TOML value (already typed) or a CLI string (parsed here) into the field's type, or say why not."""
    kind = ftype if isinstance(ftype, str) else ftype.__name__
    if from_text and kind != "str":
        text = value.strip()
        try:
            if kind == "bool":
                low = text.lower()
                if low in _TRUE:
                    return True
                if low in _FALSE:
                    return False
                raise ValueError
            if kind == "int":
                value = int(text.replace("_", ""))
            if kind == "float":
                value = float(text)
        except ValueError:  # also an int of more digits than Python converts (sys.get_int_max_str_digits)
            raise ShardfitError(f"'{_shown(value)}' is not {_KIND[kind]}", where=where,
                                fix=f"give {_KIND[kind]}") from None
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        if not INT64[0] <= value <= INT64[1]:  # every count and seed ends up in a 64-bit tensor or C integer
            raise ShardfitError(f"{_shown(value)} does not fit a 64-bit integer", where=where,
                                fix="give a smaller number")
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer beyond the float range
            raise ShardfitError(f"{_shown(value)} is too large for a float", where=where,
                                fix="give a smaller number") from None
    if kind == "str" and isinstance(value, str):
        return value
    raise ShardfitError(f"expected {_KIND[kind]}, got {type(value).__name__} {_shown(repr(value))}", where=where,
                        fix=f"give {_KIND[kind]}")


def _shown(value: Any, limit: int = 60) -> str:
    """A value as an error line quotes it: repr of non-strings, one line, at most `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _set(cfg: Config, section: str, key: str, value: Any, where: str, explicit: set[str],
         from_text: bool = False) -> None:
    sections = _sections(cfg)
    if section not in sections:
        raise ShardfitError(f"unknown section '{section}'", where=where, fix=did_you_mean(section, sections))
    fields = _fields(sections[section])
    if key not in fields:
        keys = {s: list(_fields(obj)) for s, obj in sections.items()}
        raise ShardfitError(f"unknown key '{section}.{key}'", where=where, fix=nested_section(key, sections)
                            or unknown_key_fix(section, key, keys))
    named = where if where.endswith(f"{section}.{key}") else f"{where} {section}.{key}"  # a flag names itself
    setattr(sections[section], key, _coerce(value, fields[key].type, named, from_text))
    explicit.add(f"{section}.{key}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                read_adapter: AdapterReader | None = None) -> Config:
    """read_adapter: the reader of lora.adapter's PEFT files (weights/peft_config.py's adapter_lora_fields; config
    reads no weight file itself), needed when the config names one."""
    cfg = Config()
    explicit: set[str] = set()
    weights = False
    in_file, on_line = Spellings(""), Spellings("command line")  # the old key spellings of each (spellings.py)
    if path:
        from shardfit.config.recipes import resolve

        path = resolve(str(path))  # recipe:NAME -> the shipped file
        in_file.where = str(path)
        data = _read_toml(path)
        recipe = data.pop("recipe", None)  # a recipe's description and GPU layout (config/recipes), not training keys
        # a recipe that needs model.path fine-tunes: its help and plan show the rates training will use
        needs = recipe.get("needs") if isinstance(recipe, dict) else None
        weights = isinstance(needs, dict) and "model.path" in needs
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ShardfitError(f"'{section}' must be a table like [{section}]", where=str(path),
                                    fix=did_you_mean(section, _sections(cfg)) if section not in _sections(cfg)
                                    else f"put its keys under [{section}]")
            for key, value in table.items():
                new = in_file.key(section, key, value)  # an old spelling is named beside the new one in errors
                where = str(path) if new == (section, key) else f"{path} {section}.{key}"
                _set(cfg, *new, value, where, explicit)
    in_file_keys, file_epochs, on_line_keys = set(explicit), cfg.train.epochs, set()
    for section, key, value in parse_overrides(overrides or []):
        _set(cfg, *on_line.key(section, key, value), value, f"--{section}.{key}", on_line_keys, from_text=True)
    explicit |= on_line_keys
    _steps_or_epochs(cfg, (in_file_keys, file_epochs, str(path)), (on_line_keys, cfg.train.epochs, "--train.epochs"))
    if cfg.lora.adapter and not cfg.model.path and not any(k.startswith("model.") for k in explicit):
        base = adapter_base(cfg.lora, read_adapter)  # the adapter's own base, as generate --adapter takes it
        if base:
            cfg.model.path = base
            explicit.add("model.path")
    _apply_preset(cfg, explicit)
    if cfg.lora.adapter:  # lora.* from the PEFT adapter's adapter_config.json, as model.* from config.json
        _fill(cfg, "lora", *adapter_fields(cfg.lora, read_adapter), explicit, "the adapter's shapes fix it")
    _check_keys(cfg)
    _check_rules(cfg, MODEL_RULES)
    _apply_training_defaults(cfg, explicit, weights)
    validate(cfg)
    announce(in_file, on_line)  # once the config is good: a bad one stays one error line
    return cfg


def _steps_or_epochs(cfg: Config, in_file: tuple[set[str], float, str], on_line: tuple[set[str], float, str]) -> None:
    """train.steps and train.epochs > 0 from one source (the file, or the command line) is an error; from both, the
    command line's wins (steps given there turn the file's epochs off)."""
    for keys, epochs, where in (in_file, on_line):
        if epochs > 0 and {"train.steps", "train.epochs"} <= keys:
            raise ShardfitError(f"train.steps={cfg.train.steps} and train.epochs={epochs:g} are both given",
                                where=where, fix="keep one: train.epochs passes over the data, or train.steps "
                                                 "optimizer steps")
    if "train.steps" in on_line[0] and "train.epochs" not in on_line[0]:
        cfg.train.epochs = 0.0


_TOML_FIX = ("write it as TOML: a [section] line, then key = value lines (a YAML `train: {lr: 1e-4}` is `[train]` "
             "then `lr = 1e-4`); `shardfit train --help` lists the keys, the recipes (`shardfit recipes`) are examples")


def _read_toml(path: Path) -> dict[str, Any]:
    """The file's tables, or one line saying why not (missing, a directory, unreadable, not UTF-8, YAML, not TOML)."""
    if path.suffix.lower() in (".yaml", ".yml"):  # axolotl's and torchtune's configs are YAML: say so, not "malformed"
        raise ShardfitError("shardfit configs are TOML, not YAML", where=str(path), fix=_TOML_FIX)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ShardfitError("config file not found", where=str(path), fix="check the path") from None
    except IsADirectoryError:
        raise ShardfitError("is a directory, not a config file", where=str(path),
                            fix="give the path of a .toml file") from None
    except (OSError, ValueError) as e:  # permission, an embedded NUL byte, invalid UTF-8 (UnicodeDecodeError)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise ShardfitError(f"cannot read the config file ({reason})", where=str(path),
                            fix="give a readable UTF-8 .toml file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        if _looks_like_yaml(text):
            raise ShardfitError("this is YAML: shardfit configs are TOML", where=str(path), fix=_TOML_FIX) from None
        raise ShardfitError(f"malformed TOML ({e})", where=str(path), fix="fix the TOML syntax") from None


def _looks_like_yaml(text: str) -> bool:
    """A file TOML cannot read whose first statement is YAML's: a `---` document start, or `key:` where TOML has
    `key =` or `[section]`."""
    first = next((x.strip() for x in text.splitlines() if x.strip() and not x.lstrip().startswith("#")), "")
    return first == "---" or bool(re.match(r"^[A-Za-z_][\w.-]*\s*:(\s|$)", first))


def _apply_preset(cfg: Config, explicit: set[str]) -> None:
    if cfg.model.path or cfg.model.init_from:  # init_from: a shardfit checkpoint's config (config/init_from.py)
        apply_init_from(cfg, explicit, _fill) if cfg.model.init_from else _apply_hf_config(cfg, explicit)
        return
    if cfg.model.name not in PRESETS:
        raise ShardfitError(f"unknown model preset '{cfg.model.name}'", where="model.name",
                            fix=did_you_mean(cfg.model.name, PRESETS))
    for key, value in PRESETS[cfg.model.name].items():
        if f"model.{key}" not in explicit:
            setattr(cfg.model, key, value)


_TRAINING_CHOICES = {"router_aux_coef"}  # training settings config.json stores: an explicit key wins


def _apply_hf_config(cfg: Config, explicit: set[str]) -> None:
    """model.path: the architecture comes from config.json; the tokenizer from the directory unless given."""
    from shardfit.config.families import read_hf_config

    cfg.model.path = resolve_model_path(cfg.model.path)  # a Hub id: its snapshot in the local cache
    family, fields = read_hf_config(cfg.model.path)
    fields = {k: v for k, v in fields.items() if k not in _TRAINING_CHOICES or f"model.{k}" not in explicit}
    _fill(cfg, "model", fields, f"{cfg.model.path}/config.json", explicit, "the checkpoint fixes the architecture")
    cfg.model.name = family.model_type
    tok = Path(cfg.model.path) / "tokenizer.json"
    if "data.tokenizer" not in explicit and tok.is_file():
        cfg.data.tokenizer = str(tok)


def _fill(cfg: Config, section: str, fields: dict[str, Any], source: str, explicit: set[str], why: str) -> None:
    """section.key from a file's values (config.json, adapter_config.json); an explicit key must agree with it."""
    obj, by_name = getattr(cfg, section), _fields(getattr(cfg, section))
    for key, value in fields.items():
        value = _coerce(value, by_name[key].type, f"{source} {section}.{key}", False)
        if f"{section}.{key}" in explicit and getattr(obj, key) != value:
            raise ShardfitError(f"{section}.{key}={getattr(obj, key)} conflicts with {key}={value} in {source}",
                                where=f"{section}.{key}", fix=f"drop the {section}.{key} override: {why}")
        setattr(obj, key, value)


def validate(cfg: Config) -> None:
    """Per-key checks from the schema's metadata, then the rules that tie keys together (those of train.steps once
    it is known: with train.epochs the trainer derives it from the data, then calls check_steps)."""
    _check_keys(cfg)
    _check_rules(cfg, MODEL_RULES + RULES + (() if cfg.train.epochs else STEP_RULES))


def check_steps(cfg: Config) -> None:
    """The rules that name a step of the run, against train.steps (derived from train.epochs by the trainer)."""
    _check_rules(cfg, STEP_RULES)


def range_text(meta: dict) -> str:
    """A field's range as a user reads it: '> 0', '>= 2', 'in [0, 1)', 'in (0, 1]'; '' when it has none."""
    def num(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    lo = ("[", meta["ge"]) if meta.get("ge") is not None else ("(", meta["gt"]) if meta.get("gt") is not None else None
    hi = ("]", meta["le"]) if meta.get("le") is not None else (")", meta["lt"]) if meta.get("lt") is not None else None
    if lo and hi:
        return f"in {lo[0]}{num(lo[1])}, {num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {num(lo[1])}"
    return f"{'<=' if hi[0] == ']' else '<'} {num(hi[1])}" if hi else ""


_BOUNDS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def _in_range(value: float, meta: dict) -> bool:
    return all(meta.get(k) is None or within(value, meta[k]) for k, within in _BOUNDS.items())


def _check_keys(cfg: Config) -> None:
    """Each key's choices and range (schema metadata), and every float finite: run before the model is built to
    count its parameters."""
    for sname, section in _sections(cfg).items():
        for name, f in _fields(section).items():
            value = getattr(section, name)
            meta = f.metadata
            where = f"{sname}.{name}"
            if meta.get("choices") and value not in meta["choices"]:
                if not meta.get("or_file"):
                    raise ShardfitError(f"'{_shown(value)}' is not allowed", where=where,
                                        fix="choose one of " + ", ".join(meta["choices"]))
                setattr(section, name, _named_file(value, where, meta))
            allowed = range_text(meta)
            if isinstance(value, float) and not math.isfinite(value):
                raise ShardfitError(f"{value} is not a finite number", where=where,
                                    fix="give a finite value" + (f" {allowed}" if allowed else ""))
            if allowed and not _in_range(value, meta):
                raise ShardfitError(f"{value} is out of range", where=where,
                                    fix=f"give a value {allowed}")


def _named_file(value: str, where: str, meta: dict) -> str:
    """The absolute path of the file a key's value names (a run's config.toml then names it from any directory), or
    one line: missing, a directory, unreadable, not UTF-8 or empty."""
    path, what = Path(value).expanduser(), meta["or_file"]
    fix = f"give the path of {what} file, or one of " + ", ".join(meta["choices"])
    neither = ShardfitError(f"'{_shown(value, 300)}' is neither one of {', '.join(meta['choices'])} nor a file",
                            where=where, fix=fix)
    if not value.strip():  # Path("") is the current directory
        raise neither
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise neither from None
    except IsADirectoryError:
        raise ShardfitError(f"{value} is a directory, not {what} file", where=where, fix=fix) from None
    except (OSError, ValueError) as e:  # permission, a NUL byte in the name, invalid UTF-8
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise ShardfitError(f"cannot read {value} ({reason})", where=where, fix="give a readable UTF-8 file") from None
    if not text.strip():
        raise ShardfitError(f"{value} is empty", where=where, fix=fix)
    return str(path.resolve())


def _head_dim(m) -> int:
    return m.head_dim or m.dim // m.n_heads


def _bad_layer_list(m) -> str | None:
    """Why model.dense_layers is not a list of layer indices, or None."""
    for part in filter(None, (p.strip() for p in m.dense_layers.split(","))):
        if not part.isdigit() or int(part) >= m.n_layers:
            return f"'{_shown(part)}' is not a layer index in 0..{m.n_layers - 1}"
    return None


def _bad_step_list(spec: str, steps: int) -> str | None:
    """Why memory.snapshot_steps ("3,4" or "10-12") is not a list of steps of this run, or None. Checked here, range
    by range, so that a typo like 1-10000000000 is refused instead of expanded into a set of ten billion steps."""
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.strip().isdigit() or (dash and not hi.strip().isdigit()):
            return f"cannot read '{_shown(part)}' (steps like 3,4 or 10-12)"
        first, last = int(lo), int(hi) if dash else int(lo)
        if not 1 <= first <= last <= steps:
            return f"'{_shown(part)}' is not a range of steps within 1..{steps}"
    return None


# Rules over several keys: (key to name, broken(cfg), what is wrong(cfg), fix(cfg)). MODEL_RULES run before the
# loader builds the model to count its parameters (a shape the model cannot take must not reach the build).
Rule = tuple[str, Any, Any, Any]
MODEL_RULES: tuple[Rule, ...] = (
    ("model.n_kv_heads", lambda c: c.model.n_kv_heads > c.model.n_heads or c.model.n_heads % c.model.n_kv_heads,
     lambda c: f"n_heads={c.model.n_heads} is not a multiple of n_kv_heads={c.model.n_kv_heads}",
     lambda c: "pick n_kv_heads that divides n_heads"),
    ("model.n_heads", lambda c: not c.model.head_dim and c.model.dim % c.model.n_heads,
     lambda c: f"dim={c.model.dim} is not divisible by n_heads={c.model.n_heads}",
     lambda c: "set model.head_dim or pick n_heads that divides dim"),
    ("model.head_dim", lambda c: _head_dim(c.model) % 2,
     lambda c: f"the head dimension {_head_dim(c.model)} is odd: rotary embeddings rotate pairs of channels",
     lambda c: "pick an even model.head_dim (or dim and n_heads whose quotient is even)"),
    ("model.experts_per_token", lambda c: c.model.n_experts and not (
        0 < c.model.experts_per_token <= c.model.n_experts and c.model.moe_ffn_dim),
     lambda c: f"an MoE model needs 0 < experts_per_token <= n_experts={c.model.n_experts} and moe_ffn_dim",
     lambda c: "set model.experts_per_token and model.moe_ffn_dim"),
    ("model.rope_high_freq_factor", lambda c: c.model.rope_scaling == "llama3"
     and c.model.rope_high_freq_factor <= c.model.rope_low_freq_factor,
     lambda c: f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got {c.model.rope_high_freq_factor}"
               f" <= {c.model.rope_low_freq_factor}", lambda c: "use the checkpoint's values (e.g. 4.0 and 1.0)"),
    ("model.dense_layers", lambda c: _bad_layer_list(c.model), lambda c: _bad_layer_list(c.model),
     lambda c: "give comma-separated layer indices like 0,2"),
)
RULES: tuple[Rule, ...] = (
    ("data.seq_len", lambda c: c.data.seq_len > c.model.max_seq_len,
     lambda c: f"seq_len={c.data.seq_len} is above the model's limit max_seq_len={c.model.max_seq_len}",
     lambda c: f"use data.seq_len <= {c.model.max_seq_len} or raise model.max_seq_len"),
    ("data.seq_len", lambda c: c.model.sliding_window and c.data.seq_len > c.model.sliding_window,
     lambda c: f"seq_len={c.data.seq_len} is longer than the model's sliding window {c.model.sliding_window}, "
               "which shardfit does not implement", lambda c: f"use data.seq_len <= {c.model.sliding_window}"),
    ("data.format", lambda c: c.data.mode == "pretrain" and c.data.format not in ("auto", "text"),
     lambda c: f"{c.data.format} records are fine-tuning examples, but data.mode=pretrain",
     lambda c: "set data.mode=sft (or auto), or data.format=text to pretrain on data.text_field"),
    ("data.format", lambda c: c.data.mode == "sft" and c.data.format == "text",
     lambda c: "text is pretraining documents, but data.mode=sft", lambda c: "drop data.format or data.mode"),
    ("data.format", lambda c: c.data.format not in ("auto", "text") and not c.data.path,
     lambda c: f"{c.data.format} needs data.path: the embedded corpus is text",
     lambda c: "set data.path to your fine-tuning records"),
    ("data.val_path", lambda c: c.data.val_path and c.data.val_path == c.data.path,
     lambda c: "is the same as data.path: the validation loss would measure the training data",
     lambda c: "give held-out files, or data.val_fraction to hold out part of data.path"),
    ("compute.ac_blocks", lambda c: c.compute.ac_blocks > c.model.n_layers,
     lambda c: f"{c.compute.ac_blocks} is more than the model's {c.model.n_layers} blocks",
     lambda c: f"use at most {c.model.n_layers}, or 0 to checkpoint every block"),
    ("compute.ac_blocks", lambda c: c.compute.ac_blocks and c.compute.activation_checkpoint != "full",
     lambda c: f"{c.compute.ac_blocks} picks blocks to checkpoint, but compute.activation_checkpoint="
               f"{c.compute.activation_checkpoint}", lambda c: "add compute.activation_checkpoint=full, or drop it"),
    ("compute.ac_every", lambda c: c.compute.ac_every != 1 and c.compute.activation_checkpoint != "full",
     lambda c: f"{c.compute.ac_every} picks blocks to checkpoint, but compute.activation_checkpoint="
               f"{c.compute.activation_checkpoint}", lambda c: "add compute.activation_checkpoint=full, or drop it"),
    ("compute.activation_checkpoint", lambda c: c.compute.activation_checkpoint == "auto" and not (
        c.train.micro_batch or c.train.micro_batch_tokens),
     lambda c: "auto picks the checkpointed blocks for the configured micro-batch, but train.micro_batch=0 picks the "
               "micro-batch for the configured checkpointing", lambda c: "set train.micro_batch, or a fixed "
               "compute.activation_checkpoint (none, selective, full)"),
    ("data.val_fraction", lambda c: c.data.val_path and c.data.val_fraction,
     lambda c: f"{c.data.val_fraction} is set together with data.val_path, which takes its place",
     lambda c: "give one of data.val_path and data.val_fraction"),
) + LORA_RULES + PREFERENCE_RULES


STEP_RULES: tuple[Rule, ...] = (
    ("logging.profile_step", lambda c: c.logging.profile_step > c.train.steps,
     lambda c: f"step {c.logging.profile_step} is after the last step {c.train.steps}: nothing would be profiled",
     lambda c: f"give a step in 1..{c.train.steps}, or 0"),
    ("memory.snapshot_steps", lambda c: _bad_step_list(c.memory.snapshot_steps, c.train.steps),
     lambda c: _bad_step_list(c.memory.snapshot_steps, c.train.steps),
     lambda c: f"give steps like 3,4 or 10-12 within 1..{c.train.steps}"),
)


def _check_rules(cfg: Config, rules: tuple[Rule, ...]) -> None:
    for where, broken, what, fix in rules:
        if broken(cfg):
            raise ShardfitError(what(cfg), where=where, fix=fix(cfg))
    if rules is MODEL_RULES or rules is STEP_RULES:
        return
    for key in ("tensorboard", "wandb"):  # the package, and shardfit's extra, of the same name
        # checked before any process starts or any model is built, not at the first log line
        if getattr(cfg.logging, key) and importlib.util.find_spec(key) is None:
            raise ShardfitError(f"logging.{key}=true needs the {key} package", where=f"logging.{key}",
                                fix=f"pip install 'shardfit[{key}]', or set logging.{key}=false")
    # The world size is known at launch, where the same check runs with it. Token-budget micro-batches
    # (train.micro_batch_tokens) split the global batch by tokens instead (data/batching.py).
    if cfg.train.micro_batch and not cfg.train.micro_batch_tokens:
        accumulation_steps(cfg.train.global_batch, cfg.train.micro_batch, 1)


def accumulation_steps(global_batch: int, micro_batch: int, world: int) -> int:
    """Micro-batches per rank per step; the global batch must split evenly over ranks and micro-batches."""
    per_round = micro_batch * world
    if global_batch % per_round:
        raise ShardfitError(f"global_batch={global_batch} is not a multiple of micro_batch x world size = "
                            f"{micro_batch} x {world}", where="train.global_batch",
                            fix=f"use a multiple of {per_round} or change micro_batch")
    return global_batch // per_round


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal Config."""
    lines = []
    for section, values in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def config_help(cfg: Config | None = None) -> str:
    """Every key with its type, default and help, for `shardfit train --help`: the defaults of `cfg` when given (the
    model and overrides on the command line), else those of the embedded tiny model."""
    cfg = cfg or load_config()
    base = Config()
    sized = {f"train.{k}" for k in training_defaults(0, False, False, 1, 1)}
    out = []
    for sname, section in _sections(cfg).items():
        out.append(f"[{sname}]")
        for name, f in _fields(section).items():
            ftype = f.type if isinstance(f.type, str) else f.type.__name__
            named = (*f.metadata["choices"], *(("PATH",) if f.metadata["or_file"] else ())) if f.metadata.get(
                "choices") else ()
            choices = f" {{{'|'.join(named)}}}" if named else ""
            default = _toml_value(getattr(section, name))
            note = " (by model size: see below)" if f"{sname}.{name}" in sized else ""
            if getattr(section, name) != getattr(getattr(base, sname), name) and not note:
                note = " (from the command line or the model)"
            out.append(f"  --{sname}.{name}={default}  ({ftype}{choices}) {f.metadata.get('help', '')}{note}")
    return "\n".join(out) + "\n\n" + defaults_table()
