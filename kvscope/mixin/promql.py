"""Small PromQL builders shared by rules, alerts and boards (pure string functions)."""

from __future__ import annotations

from kvscope.mixin.config import MixinConfig


def sel(cfg: MixinConfig, *matchers: str) -> str:
    """A label selector body: the config's selector plus extra matchers, in braces."""
    parts = [cfg.selector, *matchers]
    return "{" + ", ".join(p for p in parts if p) + "}"


def alternatives(values) -> str:
    """A regex matching exactly these label values: ``cpu|disk``."""
    return "|".join(values)


def le_matcher(bound: float) -> str:
    """A matcher for one bucket's ``le`` in either exposition spelling: client_python writes
    ``1.0`` where Prometheus 3 normalises to ``1``."""
    text = repr(float(bound))
    if text.endswith(".0"):
        return f'le=~"{text[:-2]}|{text[:-2]}\\\\.0"'
    return f'le="{text}"'


def promotion_pairs(tiers: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """(dst, [src, ...]) for every copy toward the GPU: the source is farther out than dst."""
    return [(dst, list(tiers[i + 1:])) for i, dst in enumerate(tiers[:-1])]


def offload_pairs(tiers: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """(src, [dst, ...]) for every copy away from the GPU: dst is farther out than src."""
    return [(src, list(tiers[i + 1:])) for i, src in enumerate(tiers[:-1])]


def _one_or_regex(label: str, values: list[str]) -> str:
    return f'{label}="{values[0]}"' if len(values) == 1 else f'{label}=~"{alternatives(values)}"'


def promotion_matchers(cfg: MixinConfig) -> list[str]:
    """Matcher sets (``src=~"cpu|disk", dst="gpu"``) that together select every promotion."""
    return [f'{_one_or_regex("src", srcs)}, dst="{dst}"' for dst, srcs in promotion_pairs(cfg.tiers)]


def offload_matchers(cfg: MixinConfig) -> list[str]:
    """Matcher sets that together select every offload (copy away from the GPU)."""
    return [f'src="{src}", {_one_or_regex("dst", dsts)}' for src, dsts in offload_pairs(cfg.tiers)]


def offload_tiers(cfg: MixinConfig) -> str:
    """Matcher for the offload tiers (every tier but the first, the GPU's own prefix cache)."""
    return _one_or_regex("tier", list(cfg.tiers[1:]))


def tier_matcher(tiers, label: str = "tier") -> str:
    """Matcher for these tiers: ``tier="cpu"``, or ``tier=~"cpu|disk"`` for several (``label``:
    another label holding tier names, e.g. ``source``)."""
    return _one_or_regex(label, list(tiers))


def union(fn: str, metric: str, cfg: MixinConfig, matcher_sets: list[str], window: str) -> str:
    """``fn(metric{sel, m1}[w]) or fn(metric{sel, m2}[w]) or ...``."""
    return "\n  or ".join(f"{fn}({metric}{sel(cfg, m)}[{window}])" for m in matcher_sets)


def _by(expr: str, by: str, new: str, old: str) -> str:
    """``expr`` summed by ``by`` and a ``new`` label holding each series' ``old`` label."""
    return f'sum by ({by}, {new}) (label_replace(\n  {expr},\n  "{new}", "$1", "{old}", "(.+)"))'


def _part(expr: str, name: str) -> str:
    """``expr`` with a ``part`` label, so that ``or`` keeps it beside parts of equal labels."""
    return f'label_replace(\n  {expr},\n  "part", "{name}", "", "")'


def promotion_seconds_by_tier(cfg: MixinConfig, window: str) -> str:
    """PromQL: promotion seconds per second by the offload tier (``tier``) whose blocks they
    moved, charged as :func:`kvscope.analysis.transfer_cost.promotion_seconds_by_tier`
    charges them: a staging leg (a promotion into a tier other than the GPU) to its source;
    of a leg ``x->gpu``, each lower tier the share of ``x->gpu``'s blocks it staged into
    ``x`` (shares over 1 scaled down together), ``x`` the rest; aggregated by ``cfg.by``."""
    by = cfg.by
    to_gpu, *staging = promotion_matchers(cfg)
    secs = _by(union("rate", "kvscope_transfer_seconds_sum", cfg, [to_gpu], window), by, "via",
               "src")
    if not staging:
        return _by(secs, by, "tier", "via")
    blocks = _by(union("rate", "kvscope_transfer_blocks_total", cfg, [to_gpu], window), by,
                 "via", "src")
    staged = (f"sum by ({by}, via, tier) (label_replace(label_replace(\n  "
              + union("rate", "kvscope_transfer_blocks_total", cfg, staging, window)
              + ',\n  "via", "$1", "dst", "(.+)"), "tier", "$1", "src", "(.+)"))')
    share = f"(\n{staged}\n/ on ({by}, via) group_left ()\n({blocks} > 0)\n)"
    total = f"sum by ({by}, via) {share}"
    below = (f"sum by ({by}, tier) (\n{share}\n/ on ({by}, via) group_left ()\n"
             f"clamp_min({total}, 1)\n* on ({by}, via) group_left ()\n{secs}\n)")
    own = (f'label_replace(\n{secs}\n* (1 - (clamp_max({total}, 1)\n'
           f'or on ({by}, via) 0 * {secs})),\n"tier", "$1", "via", "(.+)")')
    staging_own = _by(union("rate", "kvscope_transfer_seconds_sum", cfg, staging, window), by,
                      "tier", "src")
    return (f"sum by ({by}, tier) (\n" + _part(own, "own") + "\nor " + _part(below, "staged")
            + "\nor " + _part(staging_own, "staging") + "\n)")
