"""The rollout's report (kvscope.rollout.report): the page says what the judgement says."""

from __future__ import annotations

from known_runs import simulated_runs
from kvscope.analysis.compare import INCONCLUSIVE, ROLL_BACK
from kvscope.rollout import report
from kvscope.rollout.judge import judge
from kvscope.rollout.plan import aa_slot

OPTIONS = {"resamples": 400, "min_requests": 50}


def test_the_text_block_heads_with_the_final_verdict():
    """The candidate 1.15x the baseline, the A/A twin 1.3x: the rule alone rolls back, the
    A/A gate makes it inconclusive (the twin's p99 differs by about 30%, more than the
    candidate's 15%). The plain-text block of the page (``text``) must head with the final
    "inconclusive", as the banner does, not the rule's "roll back"."""
    scale = {"A": 0.1, "B": 0.115, aa_slot("A"): 0.13}
    j = judge(simulated_runs(["A", "B"], scale, seed=1, requests=400, run_sd=0.02), "A", "B",
              **OPTIONS)
    assert j.overall.verdict.decision == ROLL_BACK and j.verdict.decision == INCONCLUSIVE
    d = report.judgement_dict(j)
    assert d["text"].startswith(f"verdict: {j.verdict.text}\n"), d["text"][:200]


def test_a_difference_not_measured_reads_so_in_the_floor_table():
    """A NaN p99 difference becomes None in the JSON (json_ready): its cell reads "not
    measured" (it raised TypeError in ms(None))."""
    scale = {"A": 0.1, "B": 0.1, aa_slot("A"): 0.1}
    j = judge(simulated_runs(["A", "B"], scale, seed=0), "A", "B", **OPTIONS)
    d = report.judgement_dict(j)
    d["overall"]["ttft"][-1]["difference"]["value"] = None
    rows = report._floor_rows({"judgements": [d]})
    assert "<td>not measured</td>" in rows
