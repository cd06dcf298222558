"""The node's tiers: each sender's last snapshot of each tier it reports, and their sum per
tier (what is exported): a node's engines each report their own tiers."""

from __future__ import annotations

from collections.abc import Iterable

from kvscope import events as ev
from kvscope.vocabulary import TIERS


class TierTotals:
    """Tier snapshots by ``(scope, sender, tier)`` and their sums by tier. Not thread-safe: the
    pipeline calls it under its lock."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str, str], ev.TierSnapshot] = {}
        self.totals: dict[str, ev.TierSnapshot] = {}  # tier -> the sum over its senders

    def update(self, source: str, scope: str, snapshots: list[ev.TierSnapshot]) -> int:
        """Keep sender ``source``'s last snapshot of each tier of ``snapshots`` (two taps of
        one scope each report their own) and sum each tier's; returns the tiers ``scope``'s
        taps have reported, as a bit mask by :data:`~kvscope.vocabulary.TIERS` (the fold's
        callback)."""
        if snapshots:
            self._parts.update(((scope, source, event.tier), event) for event in snapshots)
            self._sum({event.tier for event in snapshots})
        known = {tier for (owner, _, tier) in self._parts if owner == scope}
        return sum(1 << i for i, tier in enumerate(TIERS) if tier in known)

    def forget(self, source: str) -> None:
        """Leave sender ``source``'s snapshots out of the sums from now on (its emitter closed:
        an engine that stopped holds no tier)."""
        gone = [key for key in self._parts if key[1] == source]
        for key in gone:
            del self._parts[key]
        self._sum({tier for _, _, tier in gone})

    def _sum(self, tiers: Iterable[str]) -> None:
        """Sum each of ``tiers`` over its senders' last snapshots; a tier none reports leaves."""
        for tier in tiers:
            mine = [snap for (_, _, t), snap in self._parts.items() if t == tier]
            if not mine:
                self.totals.pop(tier, None)
                continue
            self.totals[tier] = ev.TierSnapshot(
                ts=max(snap.ts for snap in mine), tier=tier,
                capacity_bytes=sum(snap.capacity_bytes for snap in mine),
                resident_bytes=_reported(snap.resident_bytes for snap in mine),
                capacity_blocks=sum(snap.capacity_blocks for snap in mine),
                resident_blocks=_reported(snap.resident_blocks for snap in mine))


def _reported(counts: Iterable[int | None]) -> int | None:
    """The sum of the senders' ``counts`` that report one (a sender of a tier's capacity alone
    adds to another's residency), None when none does."""
    known = [n for n in counts if n is not None]
    return sum(known) if known else None
