"""The Compare page: pure figures on literal comparisons, the page's render and its callback."""

import dash
import numpy as np
import pytest

from kvscope.agent.capture import CaptureWriter
from kvscope.agent.requests import RequestRecord, TransferRecord
from kvscope.analysis.compare import Budget, RequestSample, compare, to_dict
from kvscope.dashboard import figures_compare as fc
from kvscope.dashboard.access import resolve_roots
from kvscope.dashboard.pages import compare as page
from kvscope.vocabulary import TOKEN_SOURCES


def _data(budget=0.1, itl=True):
    base = RequestSample("no-cpu", np.linspace(0.1, 0.2, 200),
                         itl=np.full(200, 0.02) if itl else np.zeros(0),
                         tokens={"gpu": 100, "recompute": 300})
    cand = RequestSample("cpu", np.linspace(0.02, 0.06, 200), itl=np.full(200, 0.021),
                         promotion_wait=np.full(200, 0.001),
                         tokens={"gpu": 100, "cpu": 200, "recompute": 100},
                         transfer_bytes={"cpu->gpu": 4_000_000}, transfer_blocks={"cpu->gpu": 8},
                         transfer_seconds={"cpu->gpu": 0.2})
    return to_dict(compare(base, cand, ttft_budget=budget, resamples=200))


def test_latency_figure_has_both_runs_with_error_bars_and_the_budget():
    fig = fc.latency(_data(), "ttft")
    assert [t.name.split(" ")[0] for t in fig.data] == ["baseline", "candidate"]
    assert list(fig.data[0].x) == ["p50", "p95", "p99"]
    cand = fig.data[1]
    assert cand.y[2] <= 0.06 and all(m >= 0 for m in cand.error_y.arrayminus)
    assert any("budget 100 ms" in (a.text or "") for a in fig.layout.annotations)
    assert "s" in fig.layout.yaxis.title.text


def test_the_budget_line_reads_as_the_verdict_names_the_budget():
    """A budget of +10% over a p99 of 100.2135 ms is 110.23485 ms: the line read "budget
    110.235 ms" (six digits) beside a verdict naming "budget 110 ms" (three)."""
    fig = fc.latency(_data(budget=0.11023485), "ttft")
    assert [a.text for a in fig.layout.annotations if "budget" in (a.text or "")] == [
        "budget 110 ms"]


def test_itl_missing_on_one_side_still_draws_the_other():
    fig = fc.latency(_data(itl=False), "itl")
    assert fig.data[0].y == (None, None, None) and fig.data[1].y[0] == 0.021


def test_a_modelled_itl_is_said_not_measured_not_drawn():
    """Two demo captures: the reference engine prices decode, so every request's ITL is one
    value (itl_modelled). The text report leaves its rows out and says "ITL not measured";
    the page drew them as bars with a confidence interval, as if measured."""
    base = RequestSample("demo-a", np.linspace(0.1, 0.2, 200), itl=np.full(200, 0.001),
                         itl_modelled=True)
    cand = RequestSample("demo-b", np.linspace(0.1, 0.2, 200), itl=np.full(200, 0.001),
                         itl_modelled=True)
    fig = fc.latency(to_dict(compare(base, cand, resamples=200)), "itl")
    assert not [t for t in fig.data if t.type == "bar"]
    assert any("ITL not measured" in (a.text or "") and "baseline and the candidate" in a.text
               for a in fig.layout.annotations)
    assert [t.type for t in fc.latency(_data(), "itl").data] == ["bar", "bar"]  # measured: drawn


def test_hit_quality_and_transfer_figures():
    data = _data()
    hq = fc.hit_quality(data)
    assert [t.name for t in hq.data] == list(TOKEN_SOURCES)
    cpu = next(t for t in hq.data if t.name == "cpu")
    assert list(cpu.x) == [0.0, 0.5]
    tc = fc.transfer_cost(data)
    assert list(tc.data[1].x) == ["cpu->gpu"] and tc.data[1].y[0] == 20_000  # 4 MB / 200
    assert tc.data[0].y[0] == 0.0
    assert list(tc.data[1].customdata) == ["0.200 s, 8 blocks in all"]
    assert list(tc.data[0].customdata) == ["no transfers"]  # the baseline moved nothing
    untimed = RequestSample("vllm", np.linspace(0.1, 0.2, 200), tokens={"cpu": 1},
                            transfer_bytes={"cpu->gpu": 1000})  # bytes from vLLM's /metrics
    data = to_dict(compare(untimed, untimed, ttft_budget=None, resamples=200))
    assert list(fc.transfer_cost(data).data[0].customdata) == [
        "time not measured, blocks not measured in all"]


def test_transfer_bytes_not_measured_are_said_not_drawn_as_zero():
    """The baseline copied 8 blocks cpu->gpu in 0 bytes (its source did not know a block's
    size): bytes not measured, so no bar (it drew one of 0) and the title says so; the
    candidate's 4 MB over 200 requests is 20 kB a request."""
    def run(name, nbytes):
        return RequestSample(name, np.linspace(0.1, 0.2, 200), tokens={"cpu": 1},
                             transfer_bytes={"cpu->gpu": nbytes},
                             transfer_blocks={"cpu->gpu": 8}, transfer_seconds={"cpu->gpu": 0.2})

    fig = fc.transfer_cost(to_dict(compare(run("a", 0), run("b", 4_000_000), resamples=200)))
    assert [list(t.y) for t in fig.data] == [[None], [20_000]]
    assert fig.layout.title.text == \
        f"{fc.TRANSFER_TITLE} (cpu->gpu bytes not measured in the baseline)"


def test_the_per_level_chart_ticks_the_levels_run():
    """A rollout stopped after its first level (concurrency 1): the log axis read 0.125,
    0.25, ... 8 streams around the one point; its ticks are now the levels run, and with
    two levels both."""
    point = [{"quantile": 0.99, "value": 0.1, "low": 0.09, "high": 0.11}]
    one = fc.level_tails({"base": {"1": {"ttft": point}}, "cand": {"1": {"ttft": point}}})
    assert list(one.layout.xaxis.tickvals) == [1]
    two = fc.level_tails({"base": {"1": {"ttft": point}, "4": {"ttft": point}}})
    assert list(two.layout.xaxis.tickvals) == [1, 4] and list(two.layout.xaxis.ticktext) == \
        ["1", "4"]


def test_placeholders_and_verdict_colours():
    for fig in fc.all_figures(None):
        assert fig.layout.annotations[0].text.replace("<br>", " ") == fc.EMPTY
    assert fc.verdict_colour("roll back (disable the newest tier)") == "#d62728"
    assert fc.verdict_colour("keep") == "#2ca02c"
    assert fc.verdict_colour("inconclusive") == "#b8860b"


def _capture(directory, ttfts):
    writer = CaptureWriter(directory)
    for i, t in enumerate(ttfts):
        writer.add_request(RequestRecord(
            f"r{i}", f"{i + 1:032x}", "engine", 100.0 + i, prompt_tokens=32, ttft=float(t),
            tokens={"cpu": 16, "recompute": 16}, itl=0.01,
            transfers=(TransferRecord("cpu", "gpu", 1, 65536, 100.0 + i, 1e-4),)))
    writer.close()
    return str(directory)


def test_page_compares_two_captures_and_reports_errors_plainly(tmp_path):
    # two runs an arm, the second 0.01% slower: copies of one run measure no run-to-run variance
    b, c = (",".join(_capture(tmp_path / f"{name}{i}", x * (1 + i / 1e4)) for i in range(2))
            for name, x in (("b", np.linspace(0.02, 0.04, 150)),
                            ("c", np.linspace(0.2, 0.3, 150))))
    data, message = page.run_compare(b, c, page.form_budget("100"), resamples=200)
    assert data["verdict"]["decision"] == "roll back (disable the newest tier)"
    assert "300 requests" in message
    *figures, banner, status = page.render(data, message)
    assert len(figures) == len(page.GRAPHS) and status == message
    assert "roll back" in banner.children[0].children
    assert page.run_compare(None, c, None) == (None, fc.EMPTY)
    data, message = page.run_compare(str(tmp_path / "missing"), c, None)
    assert data is None and message.startswith("cannot compare:") and "no such capture" in message


def test_the_page_notes_a_capture_whose_size_cap_deleted_segments(tmp_path):
    """As kvscope compare notes on stderr (known_runs.write_capped_capture: 100 requests in
    10 segments, the oldest deleted by the cap), the page's status line names the capture and
    how many segments are gone; a whole capture draws no such note."""
    from known_runs import write_capped_capture, write_capture

    capped, gone = write_capped_capture(tmp_path / "capped")
    whole = write_capture(tmp_path / "whole", [0.02] * 50)
    data, message = page.run_compare(str(capped), str(whole), None, resamples=200)
    assert data is not None and message.endswith(
        f" · {capped}: {gone} of its segments are gone (deleted by its size cap, "
        "capture_max_bytes, oldest first, or lost to a failed write): requests it recorded may "
        "be missing")
    other = write_capture(tmp_path / "other", [0.03] * 50)
    data, message = page.run_compare(str(whole), str(other), None, resamples=200)
    assert data is not None and "gone" not in message


def test_page_registers_on_an_app_with_its_ids():
    app = dash.Dash(__name__)
    app.layout = page.layout()
    page.register_callbacks(app, None)
    outputs = " ".join(app.callback_map)
    for gid in (*page.GRAPHS, "compare-verdict", page.STATUS_ID, *page.FORM, page.URL_ID):
        assert gid in outputs
    assert (page.PATH, page.NAME) == ("/compare", "Compare")


def test_callback_inputs_are_all_on_the_page():
    """An Input from the shell (its ``url`` Location) would fire the callback on every page,
    where the Compare button is missing: a console error in the browser on each page load."""
    app = dash.Dash(__name__)
    app.layout = layout = page.layout()
    page.register_callbacks(app, None)

    def ids(component):
        found = {getattr(component, "id", None)}
        children = getattr(component, "children", None)
        for child in children if isinstance(children, list) else [children]:
            if hasattr(child, "to_plotly_json"):
                found |= ids(child)
        return found

    on_page = ids(layout)
    inputs = [i["id"] for cb in app.callback_map.values() for i in cb["inputs"]]
    assert {"compare-run", page.URL_ID} <= set(inputs) and set(inputs) <= on_page


def test_page_and_command_line_give_the_same_intervals(tmp_path, capsys):
    """The page drew 1,000 bootstrap resamples where `kvscope compare` draws 2,000, so the same
    two captures got different intervals in each (a new user); now both use the default."""
    import json

    from kvscope.cli import main

    b = _capture(tmp_path / "b", np.linspace(0.02, 0.04, 150))
    c = _capture(tmp_path / "c", np.linspace(0.03, 0.05, 150))
    data, _message = page.run_compare(b, c, page.form_budget("100"))
    assert main(["compare", b, c, "--ttft-budget", "0.1", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert data["ttft"] == cli["ttft"] and data["resamples"] == cli["resamples"]


def test_hit_quality_says_not_measured_for_an_arm_without_tokens_by_source(tmp_path):
    """A baseline whose records carry no tokens by source (a GPU-only vLLM seen through spans)
    gets no bar and the words "not measured"; the candidate's split is drawn."""
    from kvscope.analysis.compare import RequestSample, compare, to_dict

    data = to_dict(compare(RequestSample("spans", np.linspace(0.05, 0.1, 150)),
                           RequestSample("tap", np.linspace(0.05, 0.1, 150),
                                         tokens={"gpu": 52, "recompute": 48}), resamples=100))
    fig = fc.hit_quality(data)
    texts = [a.text for a in fig.layout.annotations]
    assert texts.count("not measured") == 1 and fig.layout.annotations[0].y == "baseline"
    gpu = next(t for t in fig.data if t.name == "gpu")
    assert list(gpu.x) == [None, 0.52]
    # zero-code arms (a tryout): vLLM's /metrics count gpu and recompute only; the legend
    # listed cpu and disk with no bar and no word. They are named in the title, not listed
    zero_code = RequestSample("zero-code", np.linspace(0.05, 0.1, 150),
                              tokens={"gpu": 68, "recompute": 32},
                              token_sources=("gpu", "recompute"))
    fig = fc.hit_quality(to_dict(compare(zero_code, zero_code, resamples=100)))
    assert [t.name for t in fig.data] == ["gpu", "recompute"]
    assert fig.layout.title.text.endswith("(cpu, disk not measured)")
    # captures whose agents reported no disk tier (a tryout ran --cpu-blocks 0 against a cpu
    # tier: "disk not measured" read as if a disk tier's hits were lost); a tier one arm had
    # is measured, its bar where it served tokens
    no_tier = [RequestSample(name, np.linspace(0.05, 0.1, 150), tokens=tokens,
                             token_sources=("gpu", *extra, "recompute"),
                             tiers_off=("cpu", "disk")[len(extra):])
               for name, tokens, extra in (("off", {"gpu": 60, "recompute": 40}, ()),
                                           ("cpu", {"gpu": 60, "cpu": 30, "recompute": 10},
                                            ("cpu",)))]
    fig = fc.hit_quality(to_dict(compare(*no_tier, resamples=100)))
    assert [t.name for t in fig.data] == ["gpu", "cpu", "recompute"]
    assert fig.layout.title.text.endswith("(no disk tier)")
    # the baseline without a cpu tier has no cpu bar: said there, not left blank
    assert [(a.y, a.text) for a in fig.layout.annotations] == [("baseline", "no cpu tier")]
    fig = fc.hit_quality(to_dict(compare(no_tier[0], zero_code, resamples=100)))
    assert fig.layout.title.text.endswith("(cpu, disk not measured)")


def test_link_opens_the_form_with_the_budget_in_milliseconds_or_a_percentage():
    link = page.parse_link("?baseline=/runs/a1,/runs/a2&candidate=/runs/b&ttft_budget=0.08")
    assert link == page.Link("/runs/a1,/runs/a2", "/runs/b", "80", "")
    # the form shows the milliseconds as written: 1001, not 1.001 * 1e3 = 1000.9999999999999
    assert page.parse_link("?baseline=a&ttft_budget=1.001").budget == "1001"
    assert page.parse_link("baseline=a&candidate=b").budget is None  # "?" is optional
    # relative, as kvscope compare --ttft-budget +10% (a "+" in a query is a space, "%2B" not)
    assert page.parse_link("?baseline=a&ttft_budget=%2B10%25").budget == "+10%"
    assert page.parse_link("?baseline=a&ttft_budget=-5%25").budget == "-5%"
    # typed unencoded into the address bar: "+" reads as a space, a lone "%" stays
    assert page.parse_link("?baseline=a&ttft_budget=+10%").budget == "+10%"
    assert page.parse_link("?candidate=b&utm_source=chat&x=1") == page.Link(None, "b", None)
    for search in (None, "", "?", "?id=r1&source=engine"):  # no compare key: form untouched
        assert page.parse_link(search) is None, search


def test_link_with_a_bad_budget_is_one_status_line():
    for raw in ("abc", "-1", "0", "nan", "inf", "0.5s", "x" * 100, "-100%25", "abc%25"):
        link = page.parse_link(f"?baseline=a&candidate=b&ttft_budget={raw}")
        assert link.budget is None and (link.baseline, link.candidate) == ("a", "b")
        assert link.error.startswith("cannot compare: ttft_budget=") and "\n" not in link.error
        assert "positive number of seconds" in link.error and len(link.error) < 250, raw


def test_link_search_writes_the_budget_as_the_command_line_takes_it_and_reads_back():
    search = page.link_search("/runs/a1,/runs/a2", "/runs/b c&d", page.form_budget("80"))
    assert search == "?baseline=/runs/a1,/runs/a2&candidate=/runs/b+c%26d&ttft_budget=0.08"
    assert page.parse_link(search) == page.Link("/runs/a1,/runs/a2", "/runs/b c&d", "80")
    assert page.link_search("a", "b", page.form_budget(" 1234.5678 ")) \
        == "?baseline=a&candidate=b&ttft_budget=1.2345678"
    search = page.link_search("a", "b", page.form_budget("+10%"))
    assert search == "?baseline=a&candidate=b&ttft_budget=%2B10%25"
    assert page.parse_link(search) == page.Link("a", "b", "+10%")
    for none in (None, "", " ", 0, "0"):  # the form's "no budget"
        assert page.form_budget(none) is None
        assert page.link_search("a", "b", page.form_budget(none)) == "?baseline=a&candidate=b"
    assert page.link_search("", None, page.form_budget("80")) == ""
    # 80 ms; a number from a session persisted while the field took numbers
    assert page.form_budget("80") == page.form_budget(80) == Budget(seconds=0.08)
    assert page.form_budget("-5%") == Budget(relative=-0.05)
    for bad in ("-5", "abc", "nan", "80ms", "-100%"):
        with pytest.raises(ValueError, match="budget"):
            page.form_budget(bad)


def test_respond_opens_a_link_and_a_click_writes_one(tmp_path):
    b = _capture(tmp_path / "b", np.linspace(0.02, 0.04, 150))
    c = _capture(tmp_path / "c", np.linspace(0.2, 0.3, 150))
    keep = dash.no_update
    n = len(page.GRAPHS) + 2  # figures, verdict, status; then the form's 3 values, the query
    roots = resolve_roots([tmp_path])  # the page reads under these only

    out = page.respond(False, f"?baseline={b}&candidate={c}&ttft_budget=0.1", None, None, None,
                       resamples=200, roots=roots)
    assert out[n:] == (b, c, "100", keep)
    assert "over the 100 ms budget" in out[n - 2].children[0].children  # 0.1 s, applied
    assert "150 requests" in out[n - 1]

    out = page.respond(True, "", b, c, "100", resamples=200, roots=roots)
    assert out[-1] == f"?baseline={b}&candidate={c}&ttft_budget=0.1" and out[n:-1] == (keep,) * 3
    assert "over the 100 ms budget" in out[n - 2].children[0].children
    # already there
    assert page.respond(True, out[-1], b, c, "100", resamples=200, roots=roots)[-1] is keep
    # relative: the baseline's p99 (about 40 ms) plus 10% is far below the candidate's 300 ms
    out = page.respond(True, "", b, c, "+10%", resamples=200, roots=roots)
    assert out[-1] == f"?baseline={b}&candidate={c}&ttft_budget=%2B10%25"
    assert "over the" in out[n - 2].children[0].children and "+10%" in str(out[n - 2])

    # the form's own bad budget: nothing read or written
    out = page.respond(True, "", b, c, "-5", roots=roots)
    assert out[n - 1].startswith("cannot compare:") and out[n:] == (keep,) * 4
    # every chart says so too, not "choose a baseline and a candidate capture"
    assert [fig.layout.annotations[0].text.replace("<br>", " ") for fig in out[:n - 2]] \
        == [out[n - 1]] * (n - 2)

    out = page.respond(False, f"?baseline={b}&candidate={c}&ttft_budget=abc", b, c, "100",
                       roots=roots)
    assert out[n - 2] == "" and "ttft_budget='abc'" in out[n - 1]
    assert out[n:] == (b, c, None, keep)
    out = page.respond(False, f"?baseline={b}", None, None, None, roots=roots)
    assert out[n - 1] == "the link names no candidate capture: type it and press Compare"
    with pytest.raises(dash.exceptions.PreventUpdate):  # persisted values stay
        page.respond(False, "?foo=1", b, c, "100", roots=roots)


def _rollout_report(directory):
    """A rollout report written by kvscope's own judge and report writer from simulated runs
    (tests/rollout/test_rollout_judge.py's): baseline ``A`` 0.1 s, candidate ``B`` 1.6x slower."""
    from known_runs import simulated_runs

    from kvscope.rollout import report
    from kvscope.rollout.judge import judge
    from kvscope.rollout.plan import aa_slot

    results = simulated_runs(["A", "B"], {"A": 0.1, "B": 0.16, aa_slot("A"): 0.1}, seed=1)
    runs = [{"index": s.index, "slot": s.slot, "arm": s.arm, "level": s.level, "rep": s.rep,
             "ttft": list(r.ttft), "itl": list(r.itl), "e2e": list(r.ttft * 2)}
            for s, r in results]
    j = judge(results, "A", "B", ttft_budget="+10%", resamples=300, min_requests=50)
    doc = {"baseline": "A", "levels": [1, 4], "repetitions": 3, "runs": runs,
           "arms": [{"name": "A"}, {"name": "B"}], "judgements": [report.judgement_dict(j)],
           "tails": report.tails(runs, resamples=200, confidence=0.95, seed=0)}
    report.write(directory, doc)
    return j


def test_the_page_opens_a_rollout_directory_and_its_candidate(tmp_path):
    """``?baseline=<rollout dir>`` alone opens its first candidate: the report's verdict (the
    judge's, A/A gate included), the overall figures, and the per-level p99 TTFT of the
    baseline, the candidate and the A/A twin; a candidate the report lacks is said so."""
    j = _rollout_report(tmp_path)
    out = page.respond(False, f"?baseline={tmp_path}", None, None, None,
                       roots=resolve_roots([tmp_path]))
    *figures, banner, status, b, c, budget, _ = out
    assert (b, c) == (str(tmp_path), None)
    assert j.verdict.text in str(banner) and "rollout" in status and "B against A" in status
    levels = figures[list(page.GRAPHS).index("compare-levels")]
    assert sorted(t.name for t in levels.data) == ["A", "A (A/A)", "B"]
    assert [list(t.x) for t in levels.data] == [[1, 4]] * 3
    data, message = page.run_compare(str(tmp_path), "C", None)
    assert data is None and "no candidate 'C' (it has B)" in message
    # a candidate names one of the report's arms, not a path: it is not held to the roots
    roots = resolve_roots([tmp_path])
    for out in (page.respond(False, f"?baseline={tmp_path}&candidate=B", None, None, None,
                             roots=roots),
                page.respond(True, "", str(tmp_path), "B", None, roots=roots)):
        status = out[len(page.GRAPHS) + 1]
        assert "B against A" in status, status
