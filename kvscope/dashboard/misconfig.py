"""Misconfiguration detectors: the guide's failure modes that a setting causes, each judged from
the dashboard's samples with what is wrong and what to change.

The same conditions as the mixin's alerts (``kvscope/mixin/alerts.py``, their runbooks in
docs/runbooks.md), with the alerts' thresholds (:class:`~kvscope.mixin.config.MixinConfig`)
applied to the window the Overview shows instead of a rate window and a ``for:``:

- ``weight-offload``: weight offload without KV offload (the guide's failure mode 2;
  KvscopeWeightOffloadWithoutKVOffload);
- ``budget-over-limit``: the host-RAM budget + reserve above the memory limit (3;
  KvscopeOffloadBudgetOverLimit);
- ``swap-in``: swap-in while a host-RAM tier is on (3; KvscopeSwapInWhileOffloading);
- ``tier-negligible``: a tier holds data but serves a negligible share of tokens (4;
  KvscopeTierIneffective, which also needs the tier nearly full);
- ``promotion-slower``: promotions slower than recompute (4;
  KvscopePromotionSlowerThanRecompute);
- ``stored-for-nothing``: evicted blocks never reused (1; KvscopeOffloadThrash);
- ``numa-remote``: the host KV pool on another NUMA node than its GPU (5;
  KvscopeKVPoolRemoteNUMA).

Each gives one :class:`Finding` whose status is one of :data:`STATUSES`. A detector whose
signal no sample carries says "not measured" and why, never "ok".

Pure: samples (the shape of :mod:`kvscope.samples`) in, findings out; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kvscope.analysis.sizing import blocks_text
from kvscope.analysis.transfer_cost import is_promotion, promotion_seconds_by_tier
from kvscope.dashboard.series import (Sample, bucket_increase, bytes_text, is_number, mapping,
                                      ordered, swap_in_increase, window_increase)
from kvscope.dashboard.topology_view import Topology
from kvscope.mixin.config import MixinConfig
from kvscope.samples import KEY_SEPARATOR
from kvscope.vocabulary import NOT_MEASURED, TIERS, TOKEN_SOURCES

MISCONFIGURED = "misconfigured"
OK = "ok"
STATUSES = (MISCONFIGURED, OK, NOT_MEASURED)
OFFLOAD_TIERS = TIERS[1:]  # every tier but the GPU's own prefix cache
# why what a tier without a token source of its own serves is not measured, never 0 (remote:
# LMCache counts its L2's hits as cpu tokens, vLLM's obj and p2p tiers promote through cpu)
_NO_SOURCE = "its hits count as another tier's tokens"
_MIXIN = MixinConfig()


@dataclass(frozen=True)
class Settings:
    """Thresholds, by default the alerts' (:class:`~kvscope.mixin.config.MixinConfig`):
    ``host_memory_tiers``: tiers whose budget is host RAM; ``negligible_share``: a tier's share
    of prompt tokens (0-1) under which it serves nothing worth its memory;
    ``recompute_faster_ratio``: promotion seconds per prefill second saved above which
    recomputing is faster; ``unused_share``: share of evicted blocks never hit (0-1) above which
    a tier stores for nothing, judged from ``min_evictions`` evicted blocks (default 20);
    ``numa_local_min_share``: share of the engine's memory (0-1) on a GPU's NUMA node."""

    host_memory_tiers: tuple[str, ...] = _MIXIN.host_memory_tiers
    negligible_share: float = _MIXIN.ineffective_max_share
    recompute_faster_ratio: float = _MIXIN.recompute_faster_ratio
    unused_share: float = _MIXIN.thrash_unused_share
    min_evictions: int = 20
    numa_local_min_share: float = _MIXIN.numa_local_min_share


@dataclass(frozen=True)
class Finding:
    """One detector's answer: ``key`` (stable, see the module), ``title`` (the
    misconfiguration), ``status`` (:data:`STATUSES`), ``wrong`` (what is wrong, with numbers;
    or why it is fine or not measured), ``change`` (what to change; empty unless misconfigured)
    and ``alert``, the mixin alert of the same condition."""

    key: str
    title: str
    status: str
    wrong: str
    change: str = ""
    alert: str = ""


TITLES = {
    "weight-offload": ("Weight offload without KV offload", "KvscopeWeightOffloadWithoutKVOffload"),
    "budget-over-limit": ("KV offload budget + reserve above the memory limit",
                          "KvscopeOffloadBudgetOverLimit"),
    "swap-in": ("Swap-in while host-RAM offload is on", "KvscopeSwapInWhileOffloading"),
    "tier-negligible": ("A tier holds data but serves a negligible share of tokens",
                        "KvscopeTierIneffective"),
    "promotion-slower": ("Promotions slower than recompute", "KvscopePromotionSlowerThanRecompute"),
    "stored-for-nothing": ("Blocks stored for nothing", "KvscopeOffloadThrash"),
    "numa-remote": ("Host KV pool on another NUMA node than its GPU", "KvscopeKVPoolRemoteNUMA"),
}


# the detectors of one host's settings: its weight offload, budget, memory limit and swap
PER_HOST = ("weight-offload", "budget-over-limit", "swap-in")


def _finding(key: str, status: str, wrong: str, change: str = "") -> Finding:
    title, alert = TITLES[key]
    return Finding(key, title, status, wrong, change if status == MISCONFIGURED else "", alert)


def _missing(key: str, field: str, how: str) -> Finding:
    return _finding(key, NOT_MEASURED, f"not measured: no sample carries {field} ({how}); the "
                    f"alert {TITLES[key][1]} evaluates it in Prometheus")


def detect(window: Sequence[Sample], settings: Settings = Settings(),
           topology: Sequence[Topology] | None = None,
           hosts: int = 1) -> tuple[Finding, ...]:
    """Every detector on ``window`` (the samples judged, oldest first) and ``topology`` (the
    node collectors' now, per instance: :func:`~kvscope.dashboard.topology_view.topologies`;
    None when they could not be read), in :data:`TITLES` order. ``hosts``: the instances the
    samples add up (a fleet view's); over more than one, the detectors of one host's settings
    (:data:`PER_HOST`) are not judged: the fleet's samples mix one host's weights, budget,
    limit and swap with another's."""
    s = settings
    if hosts > 1:
        host = [_finding(key, NOT_MEASURED, f"not judged across {hosts} instances (their "
                         "samples mix one host's settings with another's): pick an instance; "
                         f"the alert {TITLES[key][1]} judges each") for key in PER_HOST]
    else:
        host = [weight_offload(window), budget_over_limit(window, s), swap_in(window, s)]
    return (*host, tier_negligible(window, s), promotion_slower(window, s),
            stored_for_nothing(window, s), numa_remote(topology, s, engine_gpus(window)))


def kv_offload_on(window: Sequence[Sample], tiers: Sequence[str] = OFFLOAD_TIERS) -> bool:
    """Whether any of ``tiers`` has a budget or a capacity above 0 (newest sample), or blocks
    were offloaded into it in the window; in bytes or in blocks (a source without the block
    size counts blocks alone)."""
    newest = window[-1] if window else {}
    sized = any(_positive(mapping(newest, f).get(t)) for t in tiers
                for f in ("offload_budget_bytes", "tier_capacity_bytes", "tier_capacity_blocks"))
    return sized or any(v > 0 for field in ("transfer_bytes", "transfer_blocks")
                        for d, v in window_increase(window, field).items()
                        if not is_promotion(d) and d.partition("->")[2] in tiers)


def weight_offload(window: Sequence[Sample]) -> Finding:
    """``engine_weight_offload_bytes`` (bytes per GPU, vLLM's --cpu-offload-gb) above 0 while
    no offload tier is on (:func:`kv_offload_on`)."""
    key = "weight-offload"
    weights = _newest(window, "engine_weight_offload_bytes")
    if weights is None:
        return _missing(key, "engine_weight_offload_bytes",
                        "the engine's command line: no vLLM server found on this host, or "
                        "name it in [collectors.engine_args] engine_pid")
    if weights > 0 and not kv_offload_on(window):
        return _finding(key, MISCONFIGURED,
                        f"the engine keeps {bytes_text(weights)} of model weights per GPU in "
                        "host RAM (--cpu-offload-gb) and no KV offload tier is configured: this "
                        "moves weights, not KV; it adds transfer work to every forward pass",
                        "drop --cpu-offload-gb if the model fits without it; for KV offload "
                        "use --kv-offloading-size")
    return _finding(key, OK, f"weight offload {bytes_text(weights)} per GPU"
                    + (", with KV offload on" if weights > 0 else ""))


def budget_over_limit(window: Sequence[Sample], s: Settings) -> Finding:
    """The host-RAM tiers' budget (bytes) plus the reserve against the memory limit (bytes,
    ``host_memory_limit_bytes``: RAM or the cgroup limit), newest values. The cpu budget is
    the host memory part ``kv_offload`` where there is one: in a fleet (Prometheus) it is the
    same host's as the reserve and the limit, where ``offload_budget_bytes`` adds the hosts up."""
    key = "budget-over-limit"
    limit = _newest(window, "host_memory_limit_bytes")
    reserve = _newest(window, "host_memory_reserve_bytes")
    if limit is None or reserve is None:
        return _missing(key, "host_memory_limit_bytes" if limit is None
                        else "host_memory_reserve_bytes", "the host collector")
    budgets = mapping(window[-1], "offload_budget_bytes")
    own = mapping(window[-1], "host_memory_part_bytes").get("kv_offload")
    if is_number(own):  # the cpu tier's, on the host whose reserve and limit these are
        budgets = {**budgets, "cpu": own}
    known = [float(budgets[t]) for t in s.host_memory_tiers if is_number(budgets.get(t))]
    if not known:  # a sum of none is no budget of 0 bytes: "fits" said nothing true
        return _finding(key, NOT_MEASURED, f"not measured: no {'/'.join(s.host_memory_tiers)} "
                        "tier reports its budget (offload_budget_bytes: vLLM's tap sends its "
                        "cpu_bytes_to_use; in zero-code mode set [collectors.host] budgets)")
    budget = sum(known)
    over = budget + reserve - limit
    facts = (f"{'/'.join(s.host_memory_tiers)} budget {bytes_text(budget)} + reserve "
             f"{bytes_text(reserve)} against a limit of {bytes_text(limit)}")
    if over > 0:
        return _finding(key, MISCONFIGURED, f"{facts}: {bytes_text(over)} over; once the tier "
                        "fills the host swaps or the OOM killer picks a process",
                        f"shrink the budget (--kv-offloading-size / cpu_bytes_to_use) by at "
                        f"least {bytes_text(over)}, or raise the limit")
    return _finding(key, OK, f"{facts}: fits")


def swap_in(window: Sequence[Sample], s: Settings) -> Finding:
    """Bytes read back in from swap in the window (``host_swap_in_bytes``, a host-wide
    counter) above 0 while a host-RAM tier has a budget or a capacity, over the samples that
    read the host (:func:`~kvscope.dashboard.series.swap_in_increase`)."""
    key = "swap-in"
    swapped = swap_in_increase(window)
    if swapped is None or _newest(window, "host_memory_limit_bytes") is None:
        return _missing(key, "host_swap_in_bytes", "the host collector, psutil's sin")
    on = kv_offload_on(window[-1:], s.host_memory_tiers)
    if swapped > 0 and on:
        return _finding(key, MISCONFIGURED,
                        f"the host read {swapped / 2**20:.1f} MiB back in from swap in the "
                        "window while the host-RAM offload tier is configured: host RAM is "
                        "overcommitted", "shrink the tier's budget, or move what else runs on "
                        "this host; raise the agent's reserve to what the rest really uses")
    return _finding(key, OK, f"{swapped / 2**20:.1f} MiB swapped in"
                    + ("" if on else ", no host-RAM offload tier"))


def _share_of_it(ratio: float) -> str:
    """Promotion seconds over the seconds saved, as the end of a parenthesis; never "0%" for
    a measured cost."""
    if ratio == float("inf"):
        return "nothing saved)"
    return "under 1% of it)" if ratio < 0.005 else f"{ratio:.0%} of it)"


def tier_negligible(window: Sequence[Sample], s: Settings) -> Finding:
    """Each offload tier that holds data (resident bytes, or blocks where its bytes are not
    reported, above 0 in the newest sample; with no residency reported, bytes or blocks
    offloaded into it in the window) while its share of the window's prompt tokens is under
    ``negligible_share``. A tier without a token source of its own (remote) is not judged."""
    key = "tier-negligible"
    tokens = window_increase(window, "prompt_tokens")
    total = sum(tokens.values())
    if not total:
        return _finding(key, NOT_MEASURED, "not measured: no prompt tokens in the window")
    # bytes where known, else blocks (KV events without block_bytes report blocks alone)
    resident = [(mapping(window[-1], "tier_resident_bytes"), bytes_text),
                (mapping(window[-1], "tier_resident_blocks"), blocks_text)]
    stored = [({d.partition("->")[2]: v for d, v in window_increase(window, name).items()
                if not is_promotion(d)}, text)
              for name, text in (("transfer_bytes", bytes_text), ("transfer_blocks", blocks_text))]
    held = {}
    for t in OFFLOAD_TIERS:
        # a tier that reports its residency holds what it says; one that does not, what it took
        reported = any(is_number(values.get(t)) for values, _ in resident)
        amount = next((text(float(values[t])) for values, text in (resident if reported else stored)
                       if _positive(values.get(t))), None)
        if amount is not None:
            held[t] = f"holds {amount}" if reported else f"took {amount} of offloads"
    idle = {t: tokens.get(t, 0.0) / total for t in ordered(held)
            if t in TOKEN_SOURCES and tokens.get(t, 0.0) / total < s.negligible_share}
    if idle:
        what = "; ".join(f"the {t} tier {held[t]} but served {share:.2%} of "
                         f"{total:,.0f} prompt tokens" for t, share in idle.items())
        return _finding(key, MISCONFIGURED, f"{what} (negligible under "
                        f"{s.negligible_share:.0%})", "shrink or disable the tier and give the "
                        "memory back; check that lookups reach it; route requests that share "
                        "prefixes to the instance that holds them")
    if not held:
        return _finding(key, OK, "no offload tier holds data")
    lines = "; ".join(f"{t} served {tokens.get(t, 0.0) / total:.1%}" if t in TOKEN_SOURCES
                      else f"{t} {held[t]}, its share of prompt tokens not measured "
                      f"({_NO_SOURCE})" for t in ordered(held))
    if not any(t in TOKEN_SOURCES for t in held):
        return _finding(key, NOT_MEASURED, f"not measured: {lines}")
    return _finding(key, OK, lines)


def promotion_slower(window: Sequence[Sample], s: Settings) -> Finding:
    """Per offload tier, transfer seconds of promotions of its blocks (copies toward the GPU,
    a staged leg charged to the tier it staged from:
    :func:`~kvscope.analysis.transfer_cost.promotion_seconds_by_tier`) over the prefill
    seconds its tokens saved, in the window; above ``recompute_faster_ratio``: recomputing is
    faster. A tier without a token source of its own (remote) saves prefill seconds no source
    counts: not judged."""
    key = "promotion-slower"
    spent = promotion_seconds_by_tier(window_increase(window, "transfer_seconds_sum"),
                                      window_increase(window, "transfer_blocks"))
    if not spent:
        # promotions seen: their blocks or bytes (vLLM's /metrics count bytes alone), or
        # prefill an offload tier saved (KV events see no cpu->gpu copy at all)
        moved = [window_increase(window, name) for name in ("transfer_blocks", "transfer_bytes")]
        saved = window_increase(window, "prefill_seconds_saved")
        if not (any(n > 0 for counts in moved for d, n in counts.items() if is_promotion(d))
                or any(v > 0 for t, v in saved.items() if t in OFFLOAD_TIERS)):
            return _finding(key, NOT_MEASURED, "not measured: no promotions in the window")
        return _finding(key, NOT_MEASURED, "not measured: no timed promotions in the window "
                        "(vLLM's KV events and /metrics do not time cpu promotions; the tap and "
                        "the reference engine do)")
    saved = window_increase(window, "prefill_seconds_saved")
    ratio = {t: spent[t] / saved[t] if saved.get(t, 0.0) > 0 else float("inf")
             for t in ordered(spent) if t in TOKEN_SOURCES}
    slow = {t: r for t, r in ratio.items() if r > s.recompute_faster_ratio}
    # a share, not a "×": the savings card's 1.4× is saved over spent, and a tryout read this
    # line's 0.15× (spent over saved) beside it as the opposite verdict
    lines = "; ".join(f"{t}: {spent[t]:.2f} s of promotions for {saved.get(t, 0.0):.2f} s of "
                      "prefill saved (" + _share_of_it(ratio[t]) if t in ratio else
                      f"{t}: {spent[t]:.2f} s of promotions, the prefill seconds they saved "
                      f"not measured ({_NO_SOURCE})" for t in ordered(spent))
    if not ratio:
        return _finding(key, NOT_MEASURED, f"not measured: {lines}")
    if slow:
        return _finding(key, MISCONFIGURED, f"{lines}: promoting the "
                        f"{'/'.join(slow)} tier's blocks takes longer than recomputing them",
                        "disable that tier, or move it to faster storage, and compare TTFT "
                        "(kvscope compare)")
    return _finding(key, OK, lines)


def stored_for_nothing(window: Sequence[Sample], s: Settings) -> Finding:
    """Per offload tier, the share of blocks evicted in the window that were never hit while
    resident (``evicted_block_hits``' first bucket, 0 hits: a sample, weighted, of the
    evictions), from ``min_evictions`` evictions, and the evictions counted
    (``evicted_blocks``); above ``unused_share``: stored for nothing (the alert also wants
    offload traffic worth alerting on; the banner shows the waste at any rate)."""
    key = "stored-for-nothing"
    counts = {t: c for t, c in bucket_increase(window, "evicted_block_hits").items()
              if t in OFFLOAD_TIERS and c.sum() >= s.min_evictions}
    if not counts:
        return _finding(key, NOT_MEASURED, "not measured: no offload tier evicted "
                        f"{s.min_evictions} blocks with their hit counts in the window (the GPU "
                        "tier's hits make no KV events; a cache reset is no eviction for room)")
    share = {t: float(c[0] / c.sum()) for t, c in counts.items()}
    # the count from the eviction counter: the histogram's is estimated from sampled stores,
    # which repeat with their content (a tier thrashing a few prompts read 4x too many)
    evicted = window_increase(window, "evicted_blocks")
    lines = "; ".join(
        f"{t}: {v:.0%} of {evicted[t]:,.0f} evicted blocks never reused"
        if _positive(evicted.get(t)) else f"{t}: {v:.0%} of evicted blocks never reused"
        for t, v in share.items())
    if any(v > s.unused_share for v in share.values()):
        return _finding(key, MISCONFIGURED, f"{lines} (stored for nothing over "
                        f"{s.unused_share:.0%})", "admit by reuse evidence: store only blocks "
                        "seen before (vLLM store_threshold 2); grow the tier if blocks die just "
                        "before their reuse; disable it if nothing is reused")
    # under the line that says stored for nothing: "79% never reused" read oddly as fine
    return _finding(key, OK, f"{lines} (stored for nothing over {s.unused_share:.0%})")


def engine_gpus(window: Sequence[Sample]) -> set[tuple[str, str]]:
    """(instance, GPU) pairs holding the engine's KV cache in the newest sample
    (``gpu_memory_part_bytes`` ``kv_cache`` > 0, which a tap reports: its workers' KV cache
    tensors); instance "" for the one agent. Empty where no tap reports it (zero-code mode)."""
    parts = mapping(window[-1], "gpu_memory_part_bytes") if window else {}
    out = set()
    for key, value in parts.items():
        *instance, gpu, part = str(key).split(KEY_SEPARATOR)
        if part == "kv_cache" and _positive(value):
            out.add((KEY_SEPARATOR.join(instance), gpu))
    return out


def numa_remote(topology: Sequence[Topology] | None, s: Settings,
                serving: Collection[tuple[str, str]] = ()) -> Finding:
    """Per instance, the share of the engine process's memory (``engine_bytes``: dict[node,
    bytes], from ``numa_maps``) on the NUMA nodes its GPUs are nearest to (each GPU's
    ``numa_node``: NVML or sysfs); under ``numa_local_min_share`` on any instance: the host KV
    pool sits across the socket interconnect from its GPU. The engine's GPUs are those
    ``serving`` names ((instance, GPU) pairs: :func:`engine_gpus`), or every GPU of an
    instance where it names none (on a multi-socket host with GPUs on each node that cannot
    tell, and says so). An instance without either signal is not judged."""
    key = "numa-remote"
    if topology is None:
        return _missing(key, "the node collectors' topology", "the agent's /api/v1/node")
    engines = [t for t in topology if t.engine_bytes]
    if not engines:
        return _missing(key, "the engine's memory per NUMA node", "the numa collector, the "
                        "engine process a tap names or [collectors.numa] engine_pid")
    judged = []
    for t in engines:
        own = [g for g in t.gpus if (t.instance, g.gpu) in serving]
        nodes = {g.numa_node for g in own or t.gpus if g.numa_node is not None}
        total = sum(t.engine_bytes.values())
        if nodes and total > 0:
            local = sum(v for k, v in t.engine_bytes.items() if k in nodes) / total
            whose = "the engine's GPUs'" if own else "the GPUs'"
            if not own and len(nodes) > 1:
                whose = "the GPUs' (which serve the engine is not reported: no tap)"
            judged.append((t.instance, nodes, total, local, whose))
    if not judged:
        return _missing(key, "a GPU's NUMA node", "NVML or sysfs naming the GPUs' nodes")
    facts = "; ".join(f"{where + ': ' if where else ''}{local:.0%} of the engine's "
                      f"{bytes_text(total)} on {whose} NUMA node {', '.join(sorted(nodes))}"
                      for where, nodes, total, local, whose in judged)
    remote = [nodes for _w, nodes, _t, local, _o in judged if local < s.numa_local_min_share]
    if remote:
        node = min(remote[0])
        return _finding(key, MISCONFIGURED, f"{facts}: offloads and promotions cross the socket "
                        "interconnect", f"bind the engine to its GPU's node (numactl "
                        f"--cpunodebind={node} --membind={node}) and restart it")
    return _finding(key, OK, facts)


def _positive(value) -> bool:
    return is_number(value) and float(value) > 0


def _newest(window: Sequence[Sample], name: str) -> float | None:
    for x in reversed(window):
        if is_number(value := x.get(name)):
            return float(value)
    return None


def by_status(findings: Sequence[Finding]) -> Mapping[str, list[Finding]]:
    """The findings grouped by status, in :data:`STATUSES` order."""
    return {status: [f for f in findings if f.status == status] for status in STATUSES}
