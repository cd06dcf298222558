"""Replays the start of a Mooncake trace into a tiny vLLM engine (CPU build, dummy weights) as
the trace-shaped workload's token-id prompts (:mod:`kvscope.rollout.trace_workload`), one
request at a time, and writes what vLLM's prefix cache served each (its ``num_cached_tokens``)
beside kvscope's prediction, for tests/rollout/test_trace_workload.py.

Run with the vLLM environment's python, never imported by pytest:

    python tests/vllm_trace_driver.py TRACE OUT.json [--requests N] [--block-tokens T]

The engine is tests/vllm_driver.py's 2-layer Llama with prefix caching on, ``max_model_len``
1024 (requests whose scaled prompt is longer are left out of the replay), and a KV cache of
as many 32-token blocks as the replayed prompts have in all (plus spare), so that nothing is
evicted: the cache is "large enough to hold it". Each request generates one token, which is
:data:`~kvscope.rollout.trace_workload.NEVER_IN_PROMPTS` (``allowed_token_ids``), so a cached
block that holds it never matches a later prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvscope from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_driver import BLOCK, BYTES_PER_BLOCK, MODEL, write_model  # noqa: E402

from kvscope.engine.workload import read_mooncake  # noqa: E402
from kvscope.rollout.trace_workload import (NEVER_IN_PROMPTS, predicted_hits,  # noqa: E402
                                            prompt_length, prompt_token_ids)

MAX_LEN = 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--block-tokens", type=int, default=BLOCK)
    args = parser.parse_args()
    requests = [r for r in read_mooncake(args.trace)[:args.requests]
                if prompt_length(r, args.block_tokens) < MAX_LEN]
    blocks: dict[int, list[int]] = {}
    prompts = [prompt_token_ids(r, args.block_tokens, MODEL["vocab_size"], blocks)
               for r in requests]
    gpu_blocks = sum(-(-len(p) // BLOCK) + 1 for p in prompts) + 16
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=write_model(tmp), load_format="dummy", skip_tokenizer_init=True,
                  dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK,
                  num_gpu_blocks_override=gpu_blocks,
                  kv_cache_memory_bytes=gpu_blocks * BYTES_PER_BLOCK, enforce_eager=True,
                  seed=0, max_num_seqs=1, max_num_batched_tokens=MAX_LEN,
                  enable_prefix_caching=True)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                ignore_eos=True, allowed_token_ids=[NEVER_IN_PROMPTS])
        cached = []
        for prompt in prompts:  # one at a time: each sees what every earlier one cached
            result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                                  use_tqdm=False)
            cached.append(int(result[0].num_cached_tokens or 0))
    Path(args.out).write_text(json.dumps({
        "requests": [r.request_id for r in requests], "prompt_lengths": list(map(len, prompts)),
        "cached": cached, "predicted": predicted_hits(requests, args.block_tokens, BLOCK),
        "gpu_blocks": gpu_blocks}))
    os._exit(0)  # skip vLLM's slow interpreter teardown; the output is written


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
