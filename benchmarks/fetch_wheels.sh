#!/usr/bin/env bash
# Recreates the git-ignored wheel folders that device_run.sh's stages carry to the device machine (CPython 3.12.3,
# x86_64 Linux, no network): benchmarks/wheels_rl (rl*, rl-iter, clients: the tinker SDK and `shardfit serve`'s stack,
# pyproject's `serve` extra) and benchmarks/wheels_dpo (dpo: TRL for bench_dpo.py's anchor and what it needs that the
# device may lack). Pinned versions, from PyPI, with --no-deps (every dependency is named here), then a check that
# every wheel's non-extra Requires-Dist is met by the set or by the device's packages (the list below).
#   bash benchmarks/fetch_wheels.sh            # both folders (~15 MB + ~2 MB), then the check
#   FULL=1 bash benchmarks/fetch_wheels.sh     # wheels_dpo with pyarrow, pandas and their needs (~55 MB)
#   bash benchmarks/fetch_wheels.sh check      # the check alone, on the folders as they are
# PY (default: .venv/bin/python where there is one, else python3) needs pip and packaging; any Python will do (the
# flags pick cp312 wheels).
# Size: a call carries at most 64 MiB with the working tree (~5 MiB of tracked files): both folders fit one call;
# with FULL=1 wheels_dpo goes alone. FULL takes pyarrow 21.0.0 (40.8 MiB) with datasets 5.0.1 on purpose: datasets
# 5.1+ needs pyarrow>=24 (46.6 MiB, 52.5 for 26.x), which with pandas put the folder at 62 MiB. datasets 5.0.1 pins
# fsspec<=2026.6.0 and the device's fsspec is likely newer (it wins: the check's one warning); checked here on the CPU
# (Python 3.11, the same versions, fsspec 2026.9.0, transformers 5.17.0, huggingface_hub 1.33.0, accelerate 1.15.0):
# `bench_dpo.py --tiny --cases trl-lora8b,trl-full1b` trained both TRL cases (2026-12-07).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# device_run.sh's rl stages install all of these into /tmp/site (the set earlier rl runs used; ~15 MB)
RL=(tinker==0.38.0 fastapi==0.165.0 uvicorn==0.54.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
    pyqwest==0.12.0 orjson==3.13.0 zstandard==0.25.0 distro==1.9.0 sniffio==1.3.1 h2==4.4.1 hpack==4.2.0
    hyperframe==6.1.0 annotated-doc==0.0.7 anyio==4.16.0)
# the dpo stage installs each of these only where the device lacks the distribution or has an older one;
# accelerate (1.15.0 there, TRL needs >=1.10.1) and huggingface_hub (1.33.0, datasets 5.0.1 needs <2) are the device's.
# The device's image lists pyarrow, pandas, python-dateutil, six, requests, fsspec and xxhash (KINDS.md's package
# list, no versions): they are left to it (~2 MiB carried, so wheels_dpo and wheels_rl fit one call together);
# FULL=1 carries them too (55 MiB: a call of its own), for a device whose pyarrow is older than TRL's >=21.
DPO=(trl==1.16.0 datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19
     torchao==0.18.0)  # torchao: bench_dpo's -fp8 variants (3.4 MB, no requirement)
[ "${FULL:-0}" = 1 ] && DPO+=(pyarrow==21.0.0 pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0 xxhash==4.1.0
                              fsspec==2026.6.0 requests==2.32.5)

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

fetch() {  # fetch DIR SPEC...: a fresh DIR holding exactly SPEC's wheels
  local dir=$1; shift
  rm -rf "$dir"; mkdir -p "$dir"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$dir" "$@" 2> >(grep -v "^WARNING: Location" >&2)  # this machine's local indexes' noise
}

if [ "${1:-}" != check ]; then
  fetch benchmarks/wheels_rl "${RL[@]}"
  fetch benchmarks/wheels_dpo "${DPO[@]}"
fi

# The check. DEVICE: what the device's python3 has. Versions from KINDS.md's pip list (a session's, 2026-11); the
# unversioned names are inferred from those packages' own Requires-Dist (the reason beside each), not seen in a listing.
"$PY" - benchmarks/wheels_rl benchmarks/wheels_dpo <<'EOF'
import sys, zipfile
from email.parser import Parser
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon, parse_wheel_filename
from packaging.version import Version

DEVICE = {  # name: version, ">=version" (a lower bound inferred from a dependant), or None (the name alone)
    "torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "huggingface-hub": "1.33.0",
    "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2", "triton": "3.6.0", "tiktoken": "0.14.0",
    "onnx": "1.23.1", "pytorch-lightning": "2.6.6", "torch-geometric": "2.8.0.post1", "sentence-transformers": "6.0.1",
    "peft": None,  # the brief's word and device_run.sh's (PEFT anchors ran there); not in KINDS.md's filtered list
    # huggingface_hub 1.33: click>=8.4.2, filelock, fsspec, hf-xet, httpx<1, packaging, pyyaml, tqdm, typing-extensions
    "click": ">=8.4.2", "filelock": None, "fsspec": None, "packaging": None, "pyyaml": None, "tqdm": None,
    "httpx": None, "typing-extensions": None,
    "anyio": None, "certifi": None, "httpcore": None, "idna": None, "h11": None,  # httpx 0.28 -> httpcore 1 -> h11
    "psutil": None,  # accelerate 1.15 (and torch-geometric)
    "protobuf": ">=6.31.1",  # onnx 1.23.1
    "requests": None, "regex": None, "charset-normalizer": None, "urllib3": None,  # tiktoken 0.14 -> requests
    "xxhash": None, "aiohttp": None, "jinja2": None,  # torch-geometric 2.8 (jinja2 torch too)
    "rich": None, "pydantic": None, "shellingham": None,  # typer (transformers 5 needs typer; typer 0.2x needs these)
    # KINDS.md's package list of the image (no versions read): TRL needs pyarrow>=21, pandas>=2.1.1; the dpo stage
    # prints the device's versions first
    "pyarrow": None, "pandas": None, "python-dateutil": None, "six": None,
}
# Python 3.12.3 on x86_64 Linux, for the markers
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}

bad = warn = 0
for d in sys.argv[1:]:
    keeps_newer = "dpo" in d  # the dpo stage installs a wheel only where the device lacks it or has it older
    wheels = sorted(Path(d).glob("*.whl"))
    have = {}  # canonical name -> version carried
    metas = []
    for w in wheels:
        name, ver, _, _ = parse_wheel_filename(w.name)
        have[canon(name)] = ver
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            metas.append((w, Parser().parsestr(z.read(meta).decode())))
    total = sum(w.stat().st_size for w in wheels)
    print(f"== {d}: {len(wheels)} wheels, {total / 2**20:.1f} MiB")
    for w, m in metas:
        rp = m.get("Requires-Python")
        if rp and not Requirement("x" + rp).specifier.contains("3.12.3"):
            print(f"  BAD {w.name}: Requires-Python {rp}"); bad += 1
        notes = []
        for line in m.get_all("Requires-Dist") or []:
            r = Requirement(line)
            if r.marker and not r.marker.evaluate(ENV):
                continue  # extras and other platforms
            n = canon(r.name)
            if n in have:
                ok = r.specifier.contains(have[n], prereleases=True)
                also = ""
                if n in DEVICE:  # the rl stages install every wheel, so the set's shadows the device's
                    also = f", device {DEVICE[n] or 'has it'} too" + (": the newer is used" if keeps_newer else "")
                    if keeps_newer and any(s.operator in ("<", "<=", "==", "~=") for s in r.specifier):
                        also += f" WARN: needs {r.specifier}, unverified if the device's is newer"
                        warn += 1
                notes.append(f"{n} (set {have[n]}{also})" + ("" if ok else f" BAD: needs {r.specifier}"))
            elif n in DEVICE:
                v = DEVICE[n]  # a lower bound is checked as if the device had exactly it
                ok = v is None or r.specifier.contains(Version(v.lstrip(">=")), prereleases=True)
                notes.append(f"{n} (device {v or '?'}{'' if not r.specifier else ', needs ' + str(r.specifier)})"
                             + ("" if ok else " BAD"))
            else:
                ok = False
                notes.append(f"{n} BAD: neither carried nor on the device")
            bad += not ok
        print(f"  {w.name} ({w.stat().st_size / 2**20:.2f} MiB): " + ("; ".join(notes) or "no requirements"))
print("check:", "all requirements met" if not bad else f"{bad} unmet", f"({warn} warnings)" if warn else "")
sys.exit(bool(bad))
EOF
