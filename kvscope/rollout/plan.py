"""The order a rollout runs in: every arm at every concurrency level, repeated, interleaved so
that drift and noise (a warming host, a neighbour's job) hit all arms alike, with the baseline
run twice per repetition (the A/A pair) so that the noise floor is measured, not assumed.

Within a repetition the levels run in ascending order (the guide's concurrency ramp) and, at
each level, every slot (arm) once; the slots' order alternates between repetitions and levels
(A B A' ... then ... A' B A), a counterbalanced ("ABBA") order, so that no arm always runs first
or last, and a drift across the session adds to all arms alike. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

AA_SUFFIX = " (A/A)"  # the second run of the baseline per repetition: "baseline (A/A)"
DEFAULT_LEVELS = (1, 2, 4, 8, 16)
DEFAULT_REPETITIONS = 3


def streams(level: int) -> str:
    """"1 stream", "8 streams": a load level in words."""
    return f"{level} stream" + ("" if level == 1 else "s")


@dataclass(frozen=True)
class Step:
    """One run: ``slot`` (an arm's name, or the baseline's A/A twin), the arm it drives,
    concurrency ``level`` (streams), repetition ``rep`` (0-based) and ``index`` (0-based
    position in the plan, also the run's workload seed offset: no two runs share prompts)."""

    index: int
    slot: str
    arm: str
    level: int
    rep: int


def aa_slot(baseline: str) -> str:
    """The name of the baseline's A/A twin."""
    return baseline + AA_SUFFIX


def plan(arms: Sequence[str], levels: Sequence[int] = DEFAULT_LEVELS,
         repetitions: int = DEFAULT_REPETITIONS, aa: bool = True) -> list[Step]:
    """The runs, in order, for ``arms`` (the first is the baseline; names unique), each level
    (streams, >= 1, unique) and ``repetitions`` (>= 1); ``aa``: run the baseline a second time
    per level and repetition as :func:`aa_slot`. Raises ValueError for fewer than two arms, a
    repeated name or level, or a bad count."""
    if len(arms) < 2:
        raise ValueError("a rollout needs two arms or more: a baseline and a candidate")
    if len(set(arms)) != len(arms):
        raise ValueError(f"arm names repeat: {', '.join(arms)}")
    if not levels or len(set(levels)) != len(levels) or min(levels) < 1:
        raise ValueError(f"concurrency levels must be distinct integers >= 1, got {list(levels)}")
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions}")
    slots = [(arms[0], arms[0]), *((a, a) for a in arms[1:])]
    if aa:
        slots.append((aa_slot(arms[0]), arms[0]))
    steps: list[Step] = []
    for rep in range(repetitions):
        for i, level in enumerate(sorted(levels)):
            order = slots if (rep + i) % 2 == 0 else slots[::-1]
            for slot, arm in order:
                steps.append(Step(len(steps), slot, arm, level, rep))
    return steps
