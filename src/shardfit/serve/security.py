"""Who may call the server, and where a request's paths may point.

Binding: 127.0.0.1 unless --host says otherwise. Any other address requires an API key: given (--api-key or
SHARDFIT_API_KEY) or generated, written to <run dir>/api_key with mode 0600, and compared in constant time. The
file is written under a temporary name of its own (random, created exclusively and never through a symlink, so
nothing planted at a guessable name can redirect the key), then renamed over api_key (a rename replaces a link, it
does not follow it). On loopback with no key configured, any key the SDK accepts (it refuses one without the `tml-`
prefix) is let in. Each request's principal is a digest of the key it sent (`principal`): futures and idempotent
answers belong to the principal that made them.
Paths: a request names checkpoints as tinker://<run>/<weights|sampler_weights>/<name> or by a bare name; each
maps to <run dir>/checkpoints/<run>/<kind>/<name>, with every segment checked against a narrow pattern (no `..`,
no `/`, no absolute paths) and the result checked to lie inside the run directory.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from pathlib import Path

from shardfit.errors import ShardfitError

SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
KINDS = ("weights", "sampler_weights")
SDK_PREFIXES = ("tml-", "eyJ")  # what the SDK itself lets a key start with


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def setup_api_key(host: str, run_dir: Path, given: str | None) -> str | None:
    """The key every request must carry, or None (loopback, none given: any SDK key). Off loopback a key is made
    when none is given, and written 0600 to run_dir/api_key for the client."""
    if given is not None and not given.startswith(SDK_PREFIXES):
        raise ShardfitError("the API key must start with 'tml-' (the tinker SDK refuses any other)",
                            where="--api-key", fix="use a key like tml-<random letters>, or omit it")
    if given is None and is_loopback(host):
        return None
    key = given or "tml-" + secrets.token_urlsafe(32)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "api_key"
    tmp = path.with_name(f".api_key.{secrets.token_hex(8)}.tmp")
    # O_EXCL: a new file, never one planted there (O_EXCL with O_CREAT also refuses a symlink at the name, and
    # O_NOFOLLOW says so twice); 0600 from the start: never readable by others, not even briefly
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise ShardfitError("something is already at the key file's temporary name (planted?)", where=str(tmp),
                            fix="remove it, and check who can write the run directory") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return key


def principal(sent: str | None) -> str:
    """Who a request comes from, as far as the server can tell: a digest of the key it sent (never the key)."""
    return hashlib.sha256((sent or "").encode("utf-8", "surrogatepass")).hexdigest()[:32]


def key_ok(expected: str | None, sent: str | None) -> bool:
    if not sent:
        return False
    if expected is None:
        return sent.startswith(SDK_PREFIXES)
    return hmac.compare_digest(sent.encode(), expected.encode())


def check_segment(value: str, where: str) -> str:
    if not isinstance(value, str) or not SEGMENT.fullmatch(value) or ".." in value:
        raise ShardfitError(f"'{str(value)[:80]}' is not an allowed name", where=where,
                            fix="use letters, digits, '.', '_', ':' or '-' (up to 128, no '..', no '/')")
    return value


def parse_tinker_path(path: str, where: str) -> tuple[str, str, str]:
    """tinker://<run>/<kind>/<name> -> (run, kind, name), every part checked."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise ShardfitError(f"'{str(path)[:80]}' is not a tinker:// path", where=where,
                            fix="give a path save_state or save_weights_for_sampler returned: "
                                "tinker://RUN/weights/NAME")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise ShardfitError(f"'{path[:120]}' is not tinker://RUN/weights|sampler_weights/NAME", where=where,
                            fix="give a path save_state or save_weights_for_sampler returned")
    run, kind, name = parts
    return check_segment(run, where), kind, check_segment(name, where)


def checkpoint_dir(root: Path, run: str, kind: str, name: str) -> Path:
    """<root>/checkpoints/<run>/<kind>/<name>, refused if it would resolve outside root (a link included)."""
    base = (root / "checkpoints").resolve()
    target = (base / check_segment(run, "run") / kind / check_segment(name, "name")).resolve()
    if not target.is_relative_to(base):
        raise ShardfitError("the path leaves the run directory", where=f"tinker://{run}/{kind}/{name}",
                            fix="give a checkpoint of this server")
    return target
