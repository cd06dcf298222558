"""Inputs of the verdict tests whose right answer is known by construction: captures written by
the agent's own capture writer, and simulated rollout runs drawn around set TTFTs. Shared by the
analysis, rollout and dashboard tests."""

from __future__ import annotations

import numpy as np

from kvscope.agent.capture import CaptureWriter
from kvscope.agent.requests import RequestRecord, TransferRecord
from kvscope.analysis.compare import RequestSample
from kvscope.rollout.plan import plan


def write_capture(directory, ttfts, itl=0.02, cpu_tokens=0):
    """A capture of one finished request per TTFT (seconds): 64-token prompts, ``cpu_tokens``
    of them promoted from the cpu tier by one 2-block transfer (1 MB, 1 ms) each; ``itl``:
    seconds, every request's or one per request."""
    writer = CaptureWriter(directory)
    for i, ttft in enumerate(ttfts):
        transfers = [TransferRecord("cpu", "gpu", 2, 1_000_000, 1000.0 + i, 0.001)] \
            if cpu_tokens else []
        writer.add_request(RequestRecord(
            f"r{i}", f"{i + 1:032x}", "engine", 1000.0 + i, prompt_tokens=64, output_tokens=8,
            tokens={"cpu": cpu_tokens, "recompute": 64 - cpu_tokens}, transfers=transfers,
            ttft=float(ttft), promotion_wait=0.001 if cpu_tokens else 0.0,
            finished=1000.0 + i + ttft, itl=float(itl[i] if np.ndim(itl) else itl)))
    writer.close()
    return directory


def write_capped_capture(directory) -> tuple[object, int]:
    """A capture of 100 requests (TTFT 20 to 30 ms) written 10 at a time, a segment each
    (numbered 1 to 10), under a size cap that keeps the newest few; returns the directory and
    how many segments are gone: 10 less those left, counted from the directory."""
    writer = CaptureWriter(directory, max_bytes=20_000, segment_rows=10)
    for i in range(100):
        writer.add_request(RequestRecord(
            f"r{i}", f"{i + 1:032x}", "engine", 1000.0 + i, prompt_tokens=64, output_tokens=8,
            tokens={"recompute": 64}, ttft=0.02 + i * 1e-4, finished=1000.1 + i, itl=0.02))
        if i % 10 == 9:
            writer.flush()
    writer.close()
    left = len(list(directory.glob("requests-*.parquet")))
    assert 1 < left < 10, left
    return directory, 10 - left


def simulated_runs(arms, scale, *, seed, reps=3, levels=(1, 4), requests=60, run_sd=0.05,
                   itl_scale=None):
    """Runs of a plan with TTFT lognormal around ``scale[slot]`` seconds times the level (more
    streams, longer waits), each run shifted by its own factor exp(N(0, run_sd)): the run-to-run
    variance a single run cannot show. ITL likewise, a tenth of it; or, with ``itl_scale``
    (seconds), drawn on its own around it for every slot alike."""
    rng = np.random.default_rng(seed)
    out = []
    for step in plan(arms, levels, reps):
        drift = np.exp(rng.normal(0, run_sd))
        ttft = scale[step.slot] * step.level * drift * rng.lognormal(0, 0.3, requests)
        itl = ttft / 10 if itl_scale is None else \
            itl_scale * np.exp(rng.normal(0, run_sd)) * rng.lognormal(0, 0.3, requests)
        out.append((step, RequestSample(step.slot, ttft, itl, tokens={"gpu": 10, "recompute": 5},
                                        transfer_bytes={"gpu->cpu": 100})))
    return out
