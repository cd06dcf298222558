"""Publishes KV events the way SGLang does, run by tests/agent/test_sglang_kv_events.py with
the python of SGLang's environment (``bash scripts/vllm_env.sh --sglang``): every event is made
by SGLang 0.5.23's own ``KVCacheEventRecorder`` (``srt/mem_cache/events.py``: its block hashes,
its coalescing, its media) and sent by its own ``ZmqEventPublisher``
(``srt/disaggregation/kv_events.py``: msgpack encoder, sequence numbers, per-rank port offset,
replay ROUTER), one publisher per data-parallel rank as its scheduler makes them.

    python tests/sglang_driver.py SCENARIO ENDPOINT [--replay EP] [--topic T] [--dp-size N]

Each rank publishes the scenario's batches (rank r > 0 the ``rank_batches`` first of them), one
``KVEventBatch`` each, then waits until stdin closes (so that its replay endpoint still answers)
or 60 s pass. It prints ``published`` once the publishers' queues are drained.

The recorder's nodes are the radix tree's as far as it reads them (``key`` with ``token_ids``,
``extra_key``, ``cache_salt``, ``is_bigram``; ``parent``; ``hash_value``): SGLang's own
``TreeNode`` and ``RadixKey`` live in ``srt/mem_cache/radix_cache.py``, whose imports need
torchvision, which cannot load beside the CPU torch (see the test's module docstring).
"""

from __future__ import annotations

import argparse
import select
import sys
import time
from dataclasses import dataclass, field

from sglang.srt.disaggregation.kv_events import (KVEventBatch, StorageMedium,
                                                 ZmqEventPublisher)
from sglang.srt.mem_cache.events import KVCacheEventRecorder

PAGE = 4  # tokens per page (SGLang's --page-size): one KV event block each


@dataclass
class Key:
    """What the recorder reads of a RadixKey."""

    token_ids: list[int]
    extra_key: str | None = None
    cache_salt: str | None = None
    is_bigram: bool = False

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class Node:
    """What the recorder reads of a TreeNode (it fills ``hash_value`` itself)."""

    key: Key
    parent: Node | None = None
    hash_value: list[str] | None = None
    event_hash_value: list[str] | None = None
    children: dict = field(default_factory=dict)


ROOT = Node(Key([]), hash_value=[])
A = Node(Key(list(range(1, 9))), ROOT)        # 2 pages
B = Node(Key(list(range(9, 13))), A)          # 1 page, below A
C = Node(Key(list(range(100, 104))), ROOT)    # 1 page
GPU, CPU = StorageMedium.GPU, StorageMedium.CPU  # "GPU", "CPU_PINNED"
DISK, EXTERNAL = StorageMedium.DISK, StorageMedium.EXTERNAL

# scenario -> batches; a batch: (recorder call, node, medium) steps
SCENARIOS = {
    # the radix tree with HiCache: compute, write-through backup, evictions, load back, reset
    "tree": [
        [("store", A, GPU), ("store", B, GPU), ("store", C, GPU)],
        [("store", A, CPU)],                             # write-through backup of A
        [("remove", B, GPU), ("remove", A, GPU)],        # device eviction, leaf first
        [("store", A, GPU)],                             # load back into the device
        [("remove", A, CPU)],                            # host eviction
        [("clear", None, None)],                         # flush_cache
    ],
    # the media 0.5.23 defines but does not publish: a storage layer below the host pool
    "storage": [
        [("store", A, GPU), ("store", A, CPU)],
        [("store", A, EXTERNAL), ("store", C, GPU), ("store", C, CPU), ("store", C, DISK)],
        [("remove", A, CPU), ("remove", C, CPU)],
        [("store", A, CPU), ("store", C, CPU)],
        [("remove", A, EXTERNAL)],
    ],
}


def batches(scenario: str) -> list[KVEventBatch]:
    """The scenario's batches, each made by one recorder's ``take()`` as a scheduler step's."""
    recorder = KVCacheEventRecorder(enabled=True, page_size=PAGE)
    out = []
    for step in SCENARIOS[scenario]:
        for call, node, medium in step:
            if call == "store":
                recorder.record_store(node, medium=medium)
            elif call == "remove":
                recorder.record_remove(node, medium=medium)
            else:
                recorder.record_all_cleared()
        out.append(KVEventBatch(ts=time.time(), events=recorder.take()))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("endpoint")
    parser.add_argument("--replay")
    parser.add_argument("--topic", default="")
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--rank-batches", type=int, default=None,
                        help="batches ranks above 0 publish (default: all)")
    args = parser.parse_args()
    publishers = [ZmqEventPublisher(attn_dp_rank=rank, endpoint=args.endpoint,
                                    replay_endpoint=args.replay, topic=args.topic)
                  for rank in range(args.dp_size)]
    time.sleep(1.5)  # ZMQ's slow joiner: what a PUB sends before it connected is lost
    for rank, publisher in enumerate(publishers):
        made = batches(args.scenario)
        if rank > 0 and args.rank_batches is not None:
            made = made[:args.rank_batches]
        for batch in made:
            publisher.publish(batch)
    while any(not p._event_queue.empty() for p in publishers):
        time.sleep(0.05)
    print("published", flush=True)
    select.select([sys.stdin], [], [], 60)
    for publisher in publishers:
        publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
