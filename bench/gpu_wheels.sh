#!/usr/bin/env bash
# Download the wheels bench/gpu_check.py needs on a GPU machine that has no network.
#
#   bash bench/gpu_wheels.sh                       # cp312 wheels into .gpu-wheels/ (the device)
#   bash bench/gpu_wheels.sh --python 3.11 DIR     # cp311 wheels into DIR (a local test)
#
# The device (see the top of bench/gpu_check.py) has Python 3.12, torch, numpy and nvidia-ml-py,
# but not msgspec or pyzmq, which kvscope's events and the tap's emitter import. gpu_check.py
# installs every wheel of this folder into a temporary directory there (pip --no-index) before
# it imports kvscope; psutil and nvidia-ml-py come along too so that the versions that run there
# are the ones tested here. Only these four: the check imports no compiled kvscope module
# (no Cython build there) and nothing else outside the standard library and torch.
#
# The folder is emptied of wheels first (one version of each, or pip refuses the install). At
# the end it prints each wheel's size, their total, and the total of what a device run sends
# (tracked and untracked-but-not-ignored files, plus this folder); exits 1 if that is over
# 64 MiB. Needs network access here (PyPI through pip).
set -euo pipefail
exec </dev/null

PY_VERSION=3.12
DEST=""
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PY_VERSION="$2"; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) DEST="$1"; shift ;;
    esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${DEST:-$ROOT/.gpu-wheels}"
PYTHON="${PYTHON:-python3}"
LIMIT=$((64 << 20))

# the versions kvscope's .venv runs (scripts/setup.sh); keep them in step
WHEELS=(msgspec==0.23.0 pyzmq==27.3.0 psutil==7.2.2 nvidia-ml-py==13.615.71)

# pip matches a manylinux tag only when it is named exactly: name them all (glibc 2.5 to 2.39)
PLATFORMS=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64
           --platform manylinux2014_x86_64)
for n in $(seq 5 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"

"$PYTHON" - "$ROOT" "$DEST" "$LIMIT" <<'EOF'
import os
import subprocess
import sys
from pathlib import Path

root, dest, limit = Path(sys.argv[1]), Path(sys.argv[2]).resolve(), int(sys.argv[3])
wheels = sorted(dest.glob("*.whl"))
for wheel in wheels:
    print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
total = sum(w.stat().st_size for w in wheels)
print(f"{total / 2**20:8.2f} MiB  wheels in all ({len(wheels)})")
listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                         "--exclude-standard"], capture_output=True, check=True).stdout
tree = sum(os.path.getsize(root / p) for p in listed.decode().split("\0")
           if p and os.path.isfile(root / p))
inside = dest.is_relative_to(root.resolve())
sent = tree + (total if inside else 0)
print(f"{tree / 2**20:8.2f} MiB  working tree that travels (tracked, untracked not ignored)")
carry = dest.relative_to(root.resolve()) if inside else dest
print(f"{sent / 2**20:8.2f} MiB  sent to the device with carry [\"{carry}\"] "
      f"(limit {limit >> 20} MiB)")
if sent > limit:
    sys.exit("over the limit: carry less")
EOF
