#!/usr/bin/env bash
# Set up kvscope on a fresh Debian 12 machine that has Python 3.11.
#
#   bash scripts/setup.sh          # .venv with kvscope + the reference engine (enough for `kvscope demo`);
#                                  # a C compiler and Python's headers too (apt) when missing: the
#                                  # agent's fold is compiled (Cython)
#   bash scripts/setup.sh --test   # also Prometheus, Chromium, chromedriver (apt), the test extras,
#                                  # vLLM's CPU build, guidellm, LMCache and SGLang (scripts/vllm_env.sh, cached
#                                  # outside the clone)
#
# Idempotent: apt is skipped when the tools are already on PATH, the venv is reused, and the pip
# steps are skipped when a stamp (.venv/.kvscope-setup-*) keyed by a hash of pyproject.toml, setup.py,
# the compiled modules' sources and this script matches.
# Never reads stdin; runs as root or, when not root, through sudo when it is available.
set -euo pipefail
exec </dev/null

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
# Pinned so that every machine runs the same torch; on the project's machines 2.13.0 is the CPU
# build lying on disk (pip find-links), which avoids downloading the multi-GB CUDA wheels.
# Elsewhere, point pip at the CPU index first: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_SPEC="torch==2.13.0"

WANT_TEST=0
for arg in "$@"; do
    case "$arg" in
        --test) WANT_TEST=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "setup.sh: unknown argument: $arg (use --test or --help)" >&2; exit 2 ;;
    esac
done

say() { printf '[setup] %s\n' "$*"; }

export DEBIAN_FRONTEND=noninteractive
APT_UPDATED=0
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n env DEBIAN_FRONTEND=noninteractive "$@"
    else
        echo "setup.sh: need root (or sudo) to run: $*" >&2
        return 1
    fi
}
apt_install() {
    if [ "$APT_UPDATED" -eq 0 ]; then
        say "apt-get update"
        as_root apt-get update -q
        APT_UPDATED=1
    fi
    say "apt-get install $*"
    as_root apt-get install -y -q --no-install-recommends "$@"
}

# 1. System packages: only the tests need them (real Prometheus + promtool, headless Chromium).
if [ "$WANT_TEST" -eq 1 ]; then
    missing=()
    command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)   # the package also ships promtool
    command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
    if [ "${#missing[@]}" -gt 0 ]; then
        # shellcheck disable=SC2046
        apt_install $(printf '%s\n' "${missing[@]}" | sort -u)
    else
        say "prometheus, promtool, chromium, chromedriver already installed"
    fi
fi

# 2. Python >= 3.11.
PY=""
for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
        "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
        PY="$(command -v "$cand")"
        break
    fi
done
if [ -z "$PY" ]; then
    echo "setup.sh: Python 3.11 or newer is required (python3.11 / python3 not found)" >&2
    exit 1
fi
say "using $PY ($("$PY" -c 'import platform; print(platform.python_version())'))"

# 3. A C compiler and Python's headers: the agent's fold, its records, ingest's stall watch and
#    the vLLM tap's scheduler side are compiled (Cython: the .pyx files and .py files that start
#    with a `# cython:` line, built by setup.py).
pyver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
# the compiler this Python was built with is the one its extensions build with (Debian's:
# x86_64-linux-gnu-gcc, from the gcc package)
compiler="$("$PY" -c 'import sysconfig; print((sysconfig.get_config_var("CC") or "cc").split()[0])')"
if ! command -v "$compiler" >/dev/null 2>&1; then
    apt_install gcc libc6-dev
fi
if ! "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    apt_install "python${pyver}-dev"
fi

# 4. The virtual environment (recreated when it is missing or broken).
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null \
    && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    say "reusing $VENV"
else
    rm -rf "$VENV"
    say "creating $VENV"
    if ! "$PY" -m venv "$VENV"; then
        # Debian splits ensurepip into python3-venv / python3.X-venv.
        rm -rf "$VENV"
        say "venv failed (ensurepip missing?); installing python${pyver}-venv"
        apt_install "python${pyver}-venv" || apt_install python3-venv
        "$PY" -m venv "$VENV"
    fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# 5. Python packages, skipped when the stamp matches (it covers the compiled modules' sources).
EXTRAS="engine"
[ "$WANT_TEST" -eq 1 ] && EXTRAS="engine,test"
# (.py modules setup.py compiles start with a `# cython:` directive line)
compiled_sources() { { find "$ROOT/kvscope" \( -name '*.pyx' -o -name '*.pxd' \) -print0
                       grep -rlZ --include='*.py' '^# cython:' "$ROOT/kvscope"; } | sort -z; }
stamp_key() { { cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "${BASH_SOURCE[0]}"; compiled_sources | xargs -0 cat; echo "$1 $TORCH_SPEC"; } | sha256sum | cut -d' ' -f1; }
stamp_ok() { [ -f "$VENV/.kvscope-setup-$1" ] && [ "$(cat "$VENV/.kvscope-setup-$1")" = "$(stamp_key "$1")" ]; }
STAMP="$VENV/.kvscope-setup-$EXTRAS"
# A venv set up with the test extras also satisfies the plain set-up.
if { stamp_ok "$EXTRAS" || stamp_ok "engine,test"; } && "$VENV/bin/python" -c 'import kvscope.agent.fold, torch' 2>/dev/null; then
    say "python packages up to date ($EXTRAS)"
else
    say "pip install $TORCH_SPEC (CPU build)"
    "${PIP[@]}" install -q "$TORCH_SPEC"
    say "pip install -e .[$EXTRAS]"
    "${PIP[@]}" install -q -e "$ROOT[$EXTRAS]"
    stamp_key "$EXTRAS" >"$STAMP"
fi

# 6. With --test: vLLM's CPU build for the vLLM integration tests, and vLLM's GPU build's
#    scheduler side over the same packages, in a cache outside the clone keyed by their pinned
#    versions (built once, about 3.4 GB on disk each; reused by every clone after that).
if [ "$WANT_TEST" -eq 1 ]; then
    say "vLLM CPU environment (scripts/vllm_env.sh)"
    bash "$ROOT/scripts/vllm_env.sh" >/dev/null
    say "vLLM GPU build's scheduler side (scripts/vllm_env.sh --gpu-build)"
    bash "$ROOT/scripts/vllm_env.sh" --gpu-build >/dev/null
    say "guidellm, the rollout's load generator (scripts/vllm_env.sh --guidellm)"
    bash "$ROOT/scripts/vllm_env.sh" --guidellm >/dev/null
    say "LMCache's multiprocess server for the LMCache source's tests (scripts/vllm_env.sh --lmcache)"
    bash "$ROOT/scripts/vllm_env.sh" --lmcache >/dev/null
    say "SGLang's KV event classes and publisher for its KV events tests (scripts/vllm_env.sh --sglang)"
    bash "$ROOT/scripts/vllm_env.sh" --sglang >/dev/null
fi

say "done. Try: $VENV/bin/kvscope demo"
[ "$WANT_TEST" -eq 1 ] && say "tests: $VENV/bin/python -m pytest"
exit 0
