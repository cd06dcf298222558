"""Unit tests of the Requests, Tiers and Sizing pages' pure parts, and of the Prometheus
backend's conversion of PromQL answers into samples. Literal inputs; no browser, no server."""

from __future__ import annotations

import json

import pytest

from kvscope.dashboard import figures_requests as fr
from kvscope.dashboard import figures_sizing as fz
from kvscope.dashboard import figures_tiers as ft
from kvscope.dashboard import prometheus as P
from kvscope.dashboard.backend import BackendUnavailable, RequestPage
from kvscope.dashboard.pages import requests as requests_page
from kvscope.dashboard.pages import sizing as sizing_page
from kvscope.dashboard.pages import tiers as tiers_page
from kvscope.dashboard.sizing import HOW_TO_ENABLE, SizingSource, SizingState

T = 1764410000.0
RECORD = {
    "request_id": "req-7", "trace_id": "ab" * 16, "source": "engine", "arrival": T,
    "prompt_tokens": 1024, "tokens": {"gpu": 512, "cpu": 256, "recompute": 256},
    "transfers": [{"src": "cpu", "dst": "gpu", "blocks": 16, "bytes": 2_097_152,
                   "start": T + 0.003, "duration": 0.004, "ok": True},
                  {"src": "disk", "dst": "cpu", "blocks": 2, "bytes": 262_144,
                   "start": T + 0.004, "duration": 0.010, "ok": False}],
    "ttft": 0.030, "queueing": 0.002, "lookup": 0.001, "promotion_wait": 0.012,
    "prefill": 0.015, "finished": T + 0.5,
}


def annotation_texts(fig) -> list[str]:
    """The figure's annotations as one line each (a message figure wraps them with <br>)."""
    return [a.text.replace("<br>", " ") for a in fig.layout.annotations]


# --- Requests -------------------------------------------------------------------------------

def test_table_rows_in_milliseconds_with_tokens_by_source():
    (row,) = fr.table_rows([RECORD])
    assert (row["request_id"], row["source"]) == ("req-7", "engine")
    assert row["ttft_ms"] == 30.0 and row["promotion_wait_ms"] == 12.0
    assert (row["tokens_gpu"], row["tokens_cpu"], row["tokens_disk"], row["tokens_recompute"]) \
        == (512, 256, 0, 256)
    assert row["transfers"] == 2
    assert row["finished"] == "09:53:20.500"
    assert {c[0] for c in fr.COLUMNS} <= set(row)


def test_a_tier_the_agent_does_not_report_reads_no_tier_in_the_table():
    """The demo without a disk tier: every row read "disk tokens 0", as if a disk tier had
    served none, then "not measured" beside the Tiers page's "no disk tier configured". The
    agent's newest sample reports gpu and cpu, and nothing else shows a disk tier: its cells
    are None, listed in ``no_tier`` (drawn "no tier"), the others as the record has them.
    A disk tier that shows otherwise (copies into it, counted by bytes alone; its prompt
    tokens counted, 0 included) is not measured, as the Tiers page says too. Where no sample
    says (none, or none reports a tier), as before."""
    reported = {"ts": T, "tier_capacity_bytes": {"gpu": 1 << 30},
                "tier_resident_blocks": {"cpu": 5}}
    (row,) = requests_page.table(FakeBackend(samples=[reported]), None, None, 100, None)[0]
    assert (row["tokens_gpu"], row["tokens_cpu"], row["tokens_disk"],
            row["tokens_recompute"]) == (512, 256, None, 256)
    assert row["no_tier"] == ["tokens_disk"]
    for shown in ({"transfer_bytes": {"cpu->disk": 10}}, {"prompt_tokens": {"disk": 0}}):
        (row,) = requests_page.table(FakeBackend(samples=[{**reported, **shown}]), None, None,
                                     100, None)[0]
        assert row["tokens_disk"] is None and row["no_tier"] == []
        assert annotation_texts(ft.tier_residency([{**reported, **shown}], "disk")) == [
            "not measured (no source reports what the disk tier holds)"]
    for samples in ((), [{"ts": T}]):
        (row,) = requests_page.table(FakeBackend(samples=samples), None, None, 100, None)[0]
        assert row["tokens_disk"] == 0 and row["no_tier"] == []


def test_a_record_without_tokens_is_not_measured_even_where_a_tier_is_absent():
    """vLLM's span alone (no tokens by source): every token column is not measured, the
    absent disk tier's too, since nobody reported this request's tokens at all."""
    (row,) = fr.table_rows([{"request_id": "a", "source": "vllm"}], {"gpu", "cpu"})
    assert row["tokens_disk"] is None and row["tokens_gpu"] is None and row["no_tier"] == []


def test_waterfall_puts_every_part_on_one_axis_in_milliseconds():
    """queueing 0-2 ms, lookup 2-3 ms, transfers at their measured starts (3 ms, 4 ms),
    promotion wait 3-15 ms, prefill 15-30 ms, first token at 30 ms."""
    fig = fr.waterfall(RECORD)
    bars, token = fig.data
    parts = dict(zip(bars.y, zip(bars.base, bars.x)))
    assert parts["arrival → queueing"] == pytest.approx((0, 2))
    assert parts["lookup"] == pytest.approx((2, 1))
    assert parts["#1 cpu->gpu · 16 blocks · 2.0 MiB"] == pytest.approx((3, 4), abs=1e-3)
    assert parts["#2 disk->cpu · 2 blocks · 256.0 KiB · FAILED"] == pytest.approx((4, 10), abs=1e-3)
    assert parts["promotion wait"] == pytest.approx((3, 12))
    assert parts["prefill (256 recomputed tokens)"] == pytest.approx((15, 15))
    assert list(token.x) == pytest.approx([30])
    assert RECORD["trace_id"] in fig.layout.title.text
    assert fig.layout.xaxis.title.text == "time since arrival (ms)"
    assert "not attributed by the engine" not in parts


def test_waterfall_renders_parts_the_engine_left_at_zero():
    record = {**RECORD, "queueing": 0.0, "lookup": 0.0, "promotion_wait": 0.0, "prefill": 0.0,
              "transfers": []}
    bars = fr.waterfall(record).data[0]
    assert "arrival → queueing" in bars.y and "prefill (256 recomputed tokens)" in bars.y
    gap = dict(zip(bars.y, zip(bars.base, bars.x)))["not attributed by the engine"]
    assert gap == pytest.approx((0, 30))
    json.loads(fr.waterfall(record).to_json())


def test_parts_not_measured_are_labelled_so_not_drawn_as_zero():
    """vLLM's span alone: no lookup, no promotion wait (None). The table leaves the cell blank
    (the grid shows "not measured"), the waterfall names the rows so and writes no "0 ms"."""
    record = {**RECORD, "lookup": None, "promotion_wait": None, "transfers": [], "tokens": {}}
    (row,) = fr.table_rows([record])
    assert row["promotion_wait_ms"] is None and row["ttft_ms"] == 30.0
    bars = fr.waterfall(record).data[0]
    text = dict(zip(bars.y, bars.text))
    assert text["lookup: not measured"] == "" and text["promotion wait: not measured"] == ""
    assert "lookup" not in text and text["arrival → queueing"] == "2 ms"
    # no lookup reported, so how many tokens were recomputed is not known either (not 0)
    assert text["prefill (recomputed tokens not measured)"] == "15 ms"


class FakeBackend:
    kind, base_url = "agent", "http://agent:9400"

    def __init__(self, records=(RECORD,), fail=False, samples=()):
        self.records, self.fail, self.calls, self.samples = list(records), fail, [], samples

    def timeseries(self, window_seconds, instance=None):
        if self.fail:
            raise BackendUnavailable(self.base_url, "refused")
        return list(self.samples)

    def requests(self, limit, sort, descending, min_ttft, instance):
        self.calls.append((limit, sort, descending, min_ttft, instance))
        if self.fail:
            raise BackendUnavailable(self.base_url, "refused")
        return RequestPage(123, self.records)

    def request(self, request_id, instance=None, source=None):
        if self.fail:
            raise BackendUnavailable(self.base_url, "refused")
        return next((r for r in self.records if r["request_id"] == request_id
                     and source in (None, r["source"])), None)


def test_table_sorts_through_the_backend_when_it_can():
    backend = FakeBackend()
    rows, status = requests_page.table(backend, [{"column_id": "ttft_ms", "direction": "asc"}],
                                       50, 500, None)
    assert backend.calls == [(500, "ttft", False, 0.05, None)]
    assert [r["request_id"] for r in rows] == ["req-7"]
    assert "1 of 123 requests with TTFT ≥ 50 ms" in status
    rows, _ = requests_page.table(backend, [{"column_id": "tokens_cpu", "direction": "desc"}],
                                  None, 100, None)
    assert backend.calls[-1] == (100, "finished", True, None, None)  # sorted locally
    # ... ascending too, over the newest rows (it asked for the oldest ones)
    requests_page.table(backend, [{"column_id": "tokens_cpu", "direction": "asc"}], None, 100,
                        None)
    assert backend.calls[-1] == (100, "finished", True, None, None)


def test_a_locally_sorted_column_puts_not_measured_last_either_way():
    """Tokens by source are None for a request whose source did not report them: that is not
    the fewest tokens, so it comes after every number in either order, as the agent's table
    puts a missing sort key. A text column with "" and a name sorts as text (0 for "" made
    Python compare an int with a str)."""
    records = [{**RECORD, "request_id": f"req-{i}", "tokens": tokens, "instance": instance}
               for i, (tokens, instance) in enumerate([({"cpu": 5}, "b"), (None, ""),
                                                       ({"cpu": 0, "gpu": 3}, "a")])]
    for direction, expected in (("asc", [0, 5, None]), ("desc", [5, 0, None])):
        rows, _ = requests_page.table(FakeBackend(records),
                                      [{"column_id": "tokens_cpu", "direction": direction}],
                                      None, 100, None)
        assert [r["tokens_cpu"] for r in rows] == expected, direction
    rows, _ = requests_page.table(FakeBackend(records),
                                  [{"column_id": "instance", "direction": "asc"}], None, 100, None)
    assert [r["instance"] for r in rows] == ["", "a", "b"]


def test_table_and_waterfall_say_when_the_agent_is_unreachable():
    rows, status = requests_page.table(FakeBackend(fail=True), None, None, 500, None)
    assert rows == [] and status == "agent unreachable: http://agent:9400 (refused)"
    fig, details = requests_page.waterfall(FakeBackend(fail=True), "?id=req-7", None)
    assert annotation_texts(fig) == ["agent unreachable: http://agent:9400 (refused)"]


def test_deep_link_opens_the_request_and_unknown_ids_explain_themselves():
    fig, details = requests_page.waterfall(FakeBackend(), "?id=req-7", None)
    assert fig.data and "req-7" in fig.layout.title.text
    assert RECORD["trace_id"] in str(details)
    fig, details = requests_page.waterfall(FakeBackend(), "?id=nope", None)
    assert "not in the table" in annotation_texts(fig)[0]
    # a source asked for is named: the id may be in the table under another one
    fig, details = requests_page.waterfall(FakeBackend(), "?id=nope&source=bogus", None)
    assert "no request 'nope' from source 'bogus' in the table" in details
    # an id of 5,000 characters is looked up, and shown, as senders cut it: 256 of them
    fig, details = requests_page.waterfall(FakeBackend(), "?id=" + "x" * 5000, None)
    assert f"request {'x' * 256!r} is not in the table" in details
    fig, _ = requests_page.waterfall(FakeBackend(), "", None)
    assert annotation_texts(fig) == ["select a request in the table"]
    # a source longer than any source name is cut to one (the agent refused 70 characters
    # with a 422, shown as "agent unreachable")
    class Strict(FakeBackend):
        def request(self, request_id, instance=None, source=None):
            assert len(source) <= 32, source  # as the agent's API would
            return None

    fig, details = requests_page.waterfall(Strict(), "?id=req-7&source=" + "s" * 70, None)
    assert f"no request 'req-7' from source {'s' * 32!r} in the table" in details


def test_the_waterfall_counts_the_transfers_the_record_left_out():
    """A request with 70 transfers, of which its record lists 2 and counts 68 left out past
    the agent's cap: the table and the details said 2."""
    record = {**RECORD, "transfers_omitted": 68}  # RECORD lists 2
    (row,) = fr.table_rows([record])
    assert row["transfers"] == 70
    _, details = requests_page.waterfall(FakeBackend([record]), "?id=req-7", None)
    assert "70 transfers (2 drawn, 68 past the agent's cap per request)" in str(details)
    one = {**RECORD, "transfers": RECORD["transfers"][:1]}
    _, details = requests_page.waterfall(FakeBackend([one]), "?id=req-7", None)
    assert " 1 transfer · " in str(details)


def test_a_record_no_tap_saw_has_its_transfers_not_measured():
    """A request known from vLLM's span alone (zero-code mode: no tokens by source, no
    transfer) read "0 transfers", though nobody timed its promotions; one a tap saw with no
    transfer (tokens reported) still reads 0."""
    span_only = {k: v for k, v in RECORD.items() if k not in ("tokens", "transfers")}
    (row,) = fr.table_rows([span_only])
    assert row["transfers"] is None and row["tokens_gpu"] is None
    _, details = requests_page.waterfall(FakeBackend([span_only]), "?id=req-7", None)
    assert f"transfers {fr.NOT_MEASURED} · " in str(details)
    tapped = {**RECORD, "transfers": []}
    assert fr.table_rows([tapped])[0]["transfers"] == 0
    _, details = requests_page.waterfall(FakeBackend([tapped]), "?id=req-7", None)
    assert " 0 transfers · " in str(details)


def test_clicking_a_row_writes_the_deep_link():
    """Two engines' requests share the id "a b": each row's link names its source (and, in a
    fleet, its instance), and the highlight marks only that source's row. The click is AG
    Grid's ``cellClicked`` (the row's id is the grid's ``getRowId``, the row's ``id``)."""
    rows = fr.table_rows([{"request_id": "a b", "source": "vllm", "instance": "node1:9400"},
                          {"request_id": "a b", "source": "engine", "instance": "node1:9400"}])
    assert rows[0]["id"] != rows[1]["id"]
    click = {"colId": "ttft_ms", "rowIndex": 1, "rowId": rows[1]["id"], "value": 30.0}
    link = requests_page.select(click, rows)
    assert link == "?id=a+b&source=engine&instance=node1%3A9400"
    (rule,) = requests_page.highlight(link)["styleConditions"]
    assert rule["condition"] == ('params.data.request_id === "a b" && params.data.source === '
                                 '"engine" && params.data.instance === "node1:9400"')
    assert requests_page.highlight("")["styleConditions"] == []
    assert requests_page.select(None, rows) is requests_page.dash.no_update
    assert requests_page.select({**click, "rowId": "gone"}, rows) is requests_page.dash.no_update


def test_the_grids_sort_is_what_the_table_sorts_by():
    """AG Grid reports its sort in ``columnState`` (every column, ``sort`` None when unsorted);
    the table asks the backend for the column sorted first."""
    state = [{"colId": "request_id", "sort": None, "sortIndex": None, "width": 120},
             {"colId": "ttft_ms", "sort": "desc", "sortIndex": 0, "width": 90}]
    assert requests_page.sort_by(state) == [{"column_id": "ttft_ms", "direction": "desc"}]
    assert requests_page.sort_by([{"colId": "ttft_ms", "sort": None}]) == []
    assert requests_page.sort_by(None) == []
    backend = FakeBackend()
    requests_page.table(backend, requests_page.sort_by(state), None, 500, None)
    assert backend.calls == [(500, "ttft", True, None, None)]


def test_what_was_not_measured_reads_not_measured_never_0():
    """A request with no TTFT and no tokens by source: its row holds None there (the grid shows
    "not measured"), the waterfall's details say so; measured zeros stay 0."""
    record = {**RECORD, "request_id": "r-none", "ttft": None, "tokens": {}}
    rows, _ = requests_page.table(FakeBackend([record, RECORD]), None, None, 500, None)
    assert rows[0]["ttft_ms"] is None and rows[0]["tokens_gpu"] is None
    assert rows[1]["ttft_ms"] == 30.0 and rows[1]["tokens_disk"] == 0
    assert rows[0]["promotion_wait_ms"] == 12.0
    _, details = requests_page.waterfall(FakeBackend([record]), "?id=r-none", None)
    assert "TTFT not measured" in str(details)
    formats = {c["field"]: c.get("valueFormatter") for c in requests_page.column_defs()}
    assert "not measured" in formats["ttft_ms"]["function"]
    assert formats["request_id"] is None


def test_a_fleet_grid_shows_the_instance_and_marks_only_the_linked_nodes_row():
    """Two demos in a fleet both number their requests syn-N, from source "engine": the rows
    differed by instance alone, which the grid did not show, and the link's highlight matched
    both (found by a fresh-user tryout). The instance column shows in a fleet only."""
    hidden = {c["field"]: c.get("hide", False) for c in requests_page.column_defs()}
    assert hidden["instance"] and not any(v for k, v in hidden.items() if k != "instance")
    assert not any(c.get("hide") for c in requests_page.column_defs(fleet=True))
    rows = fr.table_rows([{"request_id": "syn-5", "source": "engine", "instance": i}
                          for i in ("127.0.0.1:19500", "127.0.0.1:19510")])
    (rule,) = requests_page.highlight(requests_page.select(
        {"rowId": rows[1]["id"]}, rows))["styleConditions"]
    assert rule["condition"].endswith('params.data.instance === "127.0.0.1:19510"')


def test_grid_columns_keep_their_headers_units_and_filters():
    """Every column of the table, with the header (and unit) it had; number columns take the
    comparison filter ("> 50") the DataTable's filter row took."""
    defs = requests_page.column_defs()
    assert [(c["field"], c["headerName"]) for c in defs] == [(c[0], c[1]) for c in fr.COLUMNS]
    ttft = next(c for c in defs if c["field"] == "ttft_ms")
    assert ttft["headerName"] == "TTFT (ms)"
    assert ttft["filterParams"]["textMatcher"]["function"] == requests_page.NUMBER_MATCHER
    for op in (">=", "<=", "!=", ">", "<", "="):
        assert f"startsWith('{op}')" in requests_page.NUMBER_MATCHER


def test_building_the_requests_page_raises_no_deprecation_warning():
    """Dash deprecates dash_table.DataTable (a DeprecationWarning when one is built): the page
    and the whole app build without any."""
    import warnings

    from kvscope.dashboard.app import create_app

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        requests_page.layout()
        app = create_app("http://127.0.0.1:9")
    app.kvscope.backend.close()


# --- Tiers ----------------------------------------------------------------------------------

def _s(dt, **fields):
    return {"ts": T + dt, **fields}


def test_tier_panel_says_when_a_tier_is_not_configured():
    samples = [_s(0, tier_capacity_bytes={"gpu": 100, "cpu": 200}, tier_resident_bytes={"gpu": 50})]
    assert annotation_texts(ft.tier_residency(samples, "disk")) == ["no disk tier configured"]
    # every engine has a GPU tier: unreported it is not measured (vLLM's tap reports the
    # tiers it adds, and a tryout read "no gpu tier configured")
    assert annotation_texts(ft.tier_residency([_s(0, tier_capacity_bytes={"cpu": 200})],
                                              "gpu")) == [
        "not measured (no source reports the GPU's KV cache)"]
    fig = ft.tier_residency(samples, "gpu")
    assert [t.name for t in fig.data] == ["resident", "capacity"]
    assert fig.layout.yaxis.ticksuffix == "B"


def test_a_tier_whose_capacity_is_unknown_shows_what_it_holds_and_says_so():
    """A source that reports what a tier holds but not its capacity (a TierSnapshot's 0:
    unknown; /metrics leaves the capacity out then) read "no cpu tier configured" beside the
    data it had: the residency is drawn, with no capacity line, and the title says the
    capacity was not measured."""
    samples = [_s(0, tier_capacity_bytes={"cpu": 0}, tier_resident_bytes={"cpu": 50}),
               _s(5, tier_resident_bytes={"cpu": 70})]
    fig = ft.tier_residency(samples, "cpu")
    assert [t.name for t in fig.data] == ["resident"]
    assert fig.layout.title.text.endswith("(capacity not measured)")


def test_a_tier_no_source_sizes_is_not_measured_never_empty_or_unconfigured():
    """vLLM's /metrics alone: the cpu tier served tokens and took copies, and has a budget,
    but no source reports what it holds; its panel read "no cpu tier configured". KV events
    without block_bytes: blocks resident, bytes unknown; drawn as 0 B. Now "not measured" for
    the first, the blocks (resident against capacity) for the second."""
    seen = [_s(0, prompt_tokens={"gpu": 10, "cpu": 0}, transfer_bytes={"gpu->cpu": 100}),
            _s(5, prompt_tokens={"gpu": 20, "cpu": 4}, transfer_bytes={"gpu->cpu": 300},
               offload_budget_bytes={"cpu": 1 << 30})]
    for samples in (seen, seen[:1], [_s(0, offload_budget_bytes={"cpu": 1 << 30})]):
        assert annotation_texts(ft.tier_residency(samples, "cpu")) == [
            "not measured (no source reports what the cpu tier holds)"]
    fig = ft.tier_residency(seen, "disk")
    assert annotation_texts(fig) == ["no disk tier configured"]
    assert fig.layout.title.text == "disk tier: residency"  # no blocks said to be unsized
    # its capacity alone (vLLM's config info): drawn, and what it holds said not measured
    fig = ft.tier_residency([_s(0, tier_capacity_bytes={"cpu": 1 << 30})], "cpu")
    assert [t.name for t in fig.data] == ["capacity"]
    assert fig.layout.title.text.endswith("(residency not measured)")
    blocks = [_s(0, tier_capacity_blocks={"gpu": 200}, tier_resident_blocks={"gpu": 144})]
    fig = ft.tier_residency(blocks, "gpu")
    assert [(t.name, list(t.y)) for t in fig.data] == [("resident", [144]), ("capacity", [200])]
    assert fig.layout.yaxis.title.text == "blocks"
    assert fig.layout.title.text.endswith("(blocks: their size not measured)")


def test_block_flow_says_blocks_not_measured_where_only_bytes_were_counted():
    """vLLM's /metrics count offload bytes, not blocks: "no block movement" above a throughput
    chart of 6 MB/s gpu->cpu. Now the blocks are not measured, said."""
    samples = [_s(0, transfer_bytes={"gpu->cpu": 0}), _s(5, transfer_bytes={"gpu->cpu": 3e7})]
    assert annotation_texts(ft.block_flow(samples)) == [
        "blocks copied: not measured (the sources count the copies' bytes, not their blocks)"]
    samples = [_s(0, transfer_bytes={"gpu->cpu": 3e7}), _s(5, transfer_bytes={"gpu->cpu": 3e7})]
    assert annotation_texts(ft.block_flow(samples)) == ["no block movement in this window"]


def test_block_flow_links_offloads_promotions_and_drops():
    samples = [_s(0, transfer_blocks={"gpu->cpu": 10, "cpu->gpu": 1}, dropped_blocks={"cpu": 0}),
               _s(5, transfer_blocks={"gpu->cpu": 30, "cpu->gpu": 4, "cpu->disk": 7},
                  dropped_blocks={"cpu": 2, "disk": 0})]
    sankey = ft.block_flow(samples).data[0]
    nodes = list(sankey.node.label)
    links = {(nodes[s], nodes[t]): v for s, t, v in
             zip(sankey.link.source, sankey.link.target, sankey.link.value)}
    assert links == {("gpu", "cpu"): 20, ("cpu", "gpu"): 3, ("cpu", "disk"): 7,
                     ("cpu", "dropped"): 2}
    still = [_s(0, transfer_blocks={"gpu->cpu": 1}), _s(1, transfer_blocks={"gpu->cpu": 1})]
    assert annotation_texts(ft.block_flow(still)) == ["no block movement in this window"]


def test_eviction_histograms_count_the_window_per_bucket():
    n = len(ft.HITS_LABELS)
    first, last = [0] * n, [0] * n
    last[0], last[1] = 6, 2  # 6 blocks never hit, 2 hit once
    fig = ft.eviction_hits([_s(0, evicted_block_hits={"cpu": first}),
                            _s(1, evicted_block_hits={"cpu": last})])
    (bars,) = fig.data
    assert list(bars.x) == ft.HITS_LABELS and list(bars.y)[:2] == [6, 2]
    assert ft.HITS_LABELS[:5] == ["0", "1", "2", "3-4", "5-8"]
    assert ft.AGE_LABELS[:3] == ["≤100 ms", "≤1 s", "≤10 s"] and ft.AGE_LABELS[-1] == ">1 d"
    assert annotation_texts(ft.eviction_age([_s(0)])) == ["no evictions in this window"]


def test_evictions_counted_without_age_or_hits_are_not_no_evictions():
    """vLLM's KV events: the GPU tier evicted 83 blocks, with neither age nor hits. The charts
    said "no evictions in this window"; they now give the count and what is not measured."""
    samples = [_s(0, evicted_blocks={"gpu": 17}), _s(1, evicted_blocks={"gpu": 100})]
    assert annotation_texts(ft.eviction_age(samples)) == [
        "gpu: 83 blocks evicted, their age not measured (the source reports evictions without "
        "it, e.g. vLLM's KV events)"]
    assert annotation_texts(ft.eviction_hits(samples))[0].startswith(
        "gpu: 83 blocks evicted, their hits not measured")


def test_tiers_render_gives_every_graph():
    figs = tiers_page.render([_s(0), _s(1)], 900)
    assert len(figs) == len(tiers_page.GRAPHS)


# --- Sizing ---------------------------------------------------------------------------------

SIZING = {
    "lru": {"gib": [0, 1, 2], "hit_ratio": [0, 0.2, 0.3], "method": "exact", "weight": "accesses"},
    "lru_tokens": {"gib": [0, 1, 2], "hit_ratio": [0, 0.25, 0.35], "method": "exact",
                   "weight": "tokens"},
    "arc": None,
    "cpu": {"gib": [0, 1, 2], "cpu_token_hit_share": [0, 0.2, 0.3],
            "prefill_seconds_saved": [0, 10, 12], "transfer_seconds": [0, 1, 1.5]},
    "gpu_token_hit_share": 0.05, "reuse_token_share": 0.4,
    "recommended": {"gib": 1.0, "blocks": 8, "cpu_token_hit_share": 0.2, "token_hit_share": 0.25},
    "knee": {"gib": 1.0, "blocks": 8, "cpu_token_hit_share": 0.2, "token_hit_share": 0.25},
    "offload": True, "verdict": "Offload: a 1 GiB CPU tier pays.", "kv_offloading_size_gib": 1.0,
}


def test_sizing_figures_plot_the_curves_with_units():
    curves = fz.sizing_curves(SIZING)
    assert [t.name for t in curves.data] == ["LRU, block accesses", "LRU, prompt tokens"]
    assert curves.layout.xaxis.title.text == "CPU tier size (GiB)"
    assert curves.layout.yaxis.tickformat == ".0%"
    cost = fz.sizing_cost(SIZING)
    assert list(cost.data[0].y) == [0, 10, 12] and cost.layout.yaxis.ticksuffix == "s"
    # the GPU cache's size is marked where one was given: below it, the curve is not yet the
    # GPU's and the CPU tier's hits together
    def marks(fig):
        return [a.text for a in fig.layout.annotations]

    assert "GPU cache 0.5 GiB" in marks(fz.sizing_curves({**SIZING, "gpu_cache_gib": 0.5}))
    assert not any(m.startswith("GPU cache") for m in marks(curves))
    # its label reads from the line into the chart: left of a line near the y axis it ran
    # past the figure's edge, cut off (the demo's 0.0078 GiB of 0.18)
    for gib, anchor in ((0.1, "left"), (1.9, "right")):
        for fig in (fz.sizing_curves({**SIZING, "gpu_cache_gib": gib}),
                    fz.sizing_cost({**SIZING, "gpu_cache_gib": gib})):
            label, = (a for a in fig.layout.annotations if a.text.startswith("GPU cache"))
            assert label.xanchor == anchor, gib


def test_sizing_page_says_how_to_enable_it_without_a_trace():
    curves, cost, verdict, status = sizing_page.render(SizingSource(None).state())
    assert status == HOW_TO_ENABLE and "--sizing-trace" in status
    assert annotation_texts(curves) == ["no trace given (see above)"]
    curves, cost, verdict, status = sizing_page.render(SizingState("ready", "t.jsonl", SIZING, "x"))
    assert "Offload: a 1 GiB CPU tier pays." in str(verdict) and "t.jsonl" in status


def test_a_trace_that_cannot_be_analysed_is_said_on_the_page_and_in_the_log(tmp_path, caplog):
    """The CLI checks only that --sizing-trace exists and has a known suffix; its content is
    read in the background, so a malformed line was said on the Sizing page alone."""
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\nnot json\n')
    source = SizingSource(str(trace))
    with caplog.at_level("ERROR", logger="kvscope.dashboard.sizing"):
        source.start()
        state = source.wait(60)
    assert state.status == "failed" and state.message.startswith(f"cannot analyse {trace}: ")
    assert caplog.records and caplog.records[0].getMessage().endswith(state.message)
    curves, cost, verdict, status = sizing_page.render(state)
    assert status == state.message


def test_sizing_page_says_when_the_recommended_tier_exceeds_the_nodes_memory():
    """A tryout's Sizing page recommended 32.6 GiB on a 23.5 GiB host without a word. SIZING
    recommends 1 GiB: over a limit of 1 GiB - 1 byte it is said, under 1 GiB + 1 byte not,
    nor without a limit known."""
    state = SizingState("ready", "t.jsonl", SIZING, "x")
    for limit, said in ((2**30 - 1, True), (2**30 + 1, False), (None, False)):
        verdict = str(sizing_page.render(state, limit)[2])
        assert ("sizing-over-host" in verdict) is said, (limit, verdict)
    # the limit is the agent's newest; a fleet's (Prometheus: summed over nodes) is none
    class Samples(FakeBackend):
        def timeseries(self, window_seconds, instance=None):
            if self.fail:
                raise BackendUnavailable(self.base_url, "refused")
            return [{"ts": 1.0, "host_memory_limit_bytes": 5.0}, {"ts": 2.0},
                    {"ts": 3.0, "host_memory_limit_bytes": 7.0}, {"ts": 4.0}]

    agent, fleet = Samples(), Samples()
    fleet.kind = "prometheus"
    assert sizing_page.host_limit(agent) == 7.0 and sizing_page.host_limit(fleet) is None
    assert sizing_page.host_limit(Samples(fail=True)) is None


@pytest.mark.parametrize("gib,flag,shown", [(31.13, 31.2, "31.13"), (1131.13, 1131.2, "1,131.13"),
                                            (0.0123, 0.1, "0.0123")])
def test_sizing_page_shows_the_size_it_rounds_up_for_vllm(gib, flag, shown):
    """The size is rounded up to 0.1 GiB for --kv-offloading-size; at 3 or 4 significant
    digits 31.13 read 31.1 and 1,131.13 read 1,131, below the flag's value, as if the two
    disagreed. Two decimals from 1 GiB; small sizes keep 3 digits."""
    data = {**SIZING, "recommended": {**SIZING["recommended"], "gib": gib},
            "kv_offloading_size_gib": flag}
    curves, cost, verdict, status = sizing_page.render(SizingState("ready", "t.jsonl", data, "x"))
    assert f"Recommended CPU tier: {shown} GiB" in str(verdict)
    assert f"--kv-offloading-size {flag:g}" in str(verdict)
    assert "token hit share 25.0% with the GPU cache's (the CPU tier's 20.0%)" in str(verdict)
    assert f"recommended {shown} GiB" in annotation_texts(curves)
    assert "own CPU tier" not in str(verdict)  # a trace has none


def test_sizing_page_shows_the_captures_own_tier_beside_the_recommendation():
    """A capture whose engine reported its cpu tier: the page says what that tier serves by the
    same curve, so an operator sees the recommendation against what they run."""
    data = {**SIZING, "current": {"gib": 0.5, "blocks": 4096, "token_hit_share": 0.125,
                                  "cpu_token_hit_share": 0.0625}}
    verdict = str(sizing_page.render(SizingState("ready", "cap", data, "x"))[2])
    assert ("The capture's own CPU tier: 0.5 GiB (4,096 blocks), token hit share 12.5% (the "
            "CPU tier's 6.2%) by the same curve") in verdict


def test_sizing_credits_the_gpu_prefix_cache_it_is_given(tmp_path):
    """The demo's Sizing page once assumed no GPU cache (0% of tokens from it) beside a demo
    with a GPU tier. Four requests of 512-token blocks [0,1,2] (1536 tokens), [0,1,3] (1100),
    [0,1] (1024), [7] (512); a GPU cache of 2048 tokens holds 4 blocks, LRU: the first misses
    all, the second finds 0 and 1 (1024 tokens), the third 0 and 1 (1024), the last nothing:
    2048 of 4172 tokens, 0.4909."""
    import json

    records = [(0, 1536, [0, 1, 2]), (1000, 1100, [0, 1, 3]), (3000, 1024, [0, 1]),
               (4000, 512, [7])]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": 1,
                                        "hash_ids": ids}) + "\n" for ts, n, ids in records))
    source = SizingSource(str(path), "tiny", gpu_tokens=2048)
    source.start()
    state = source.wait(60)
    assert state.data["gpu_token_hit_share"] == pytest.approx(2048 / 4172)
    # 4 blocks of 512 tokens at tiny's 2 KiB per token: 4 MiB
    assert state.data["gpu_cache_gib"] == pytest.approx(4 * 512 * 2048 / 2**30)
    assert "GPU prefix cache 2,048 tokens" in state.message
    # a trace has no KV bytes of its own: the preset's, and the option naming the model
    assert "(preset tiny; --sizing-preset for your model)" in state.message
    assert not any("No GPU prefix cache" in note for note in state.data["notes"])


def test_sizing_source_reports_an_unreadable_trace(tmp_path):
    source = SizingSource(str(tmp_path / "missing.jsonl"))
    source.start()
    state = source.wait(30)
    assert state.status == "failed" and "missing.jsonl" in state.message


# --- Prometheus answers -> samples ----------------------------------------------------------

def _series(metric, points):
    return {"metric": metric, "values": [[t, str(v)] for t, v in points]}


def test_counter_rates_become_running_sums_whose_rates_match_promql():
    """rate 2/s then 4/s at a 5 s step: cumulative 10, 30 -> the figures' rate is 4/s."""
    samples = {T: {"ts": T}, T + 5: {"ts": T + 5}}
    present: set = set()
    P._counter_into(("source",), 5.0)(
        samples, "prompt_tokens", [_series({"source": "gpu"}, [(T, 2), (T + 5, 4)])], present)
    assert [samples[t]["prompt_tokens"]["gpu"] for t in (T, T + 5)] == [10, 30]
    assert present == {T, T + 5}


def test_cumulative_le_buckets_become_per_bucket_counts():
    samples = {T: {"ts": T}}
    result = [_series({"tier": "cpu", "le": "0"}, [(T, 1)]),
              _series({"tier": "cpu", "le": "+Inf"}, [(T, 3)]),
              _series({"tier": "cpu", "le": "1"}, [(T, 2)])]
    P._buckets_into(("tier",), 1.0)(samples, "evicted_block_hits", result, set())
    assert samples[T]["evicted_block_hits"] == {"cpu": [1, 1, 1]}


def test_quantiles_by_direction_and_nan_dropped():
    samples = {T: {"ts": T}}
    P._quantile_into("p95", ("src", "dst"))(
        samples, "transfer_seconds", [_series({"src": "cpu", "dst": "gpu"}, [(T, 0.002)]),
                                      _series({"src": "gpu", "dst": "cpu"}, [(T, "NaN")])], set())
    assert samples[T]["transfer_seconds"] == {"cpu->gpu": {"p95": 0.002}}


def test_without_a_dropped_metric_the_lowest_tier_drops_its_evictions():
    samples = {T: {"ts": T, "evicted_blocks": {"gpu": 5, "cpu": 3}}}
    P._fallback_dropped(samples)
    assert samples[T]["dropped_blocks"] == {"cpu": 3}


def test_prometheus_backend_unreachable_is_a_typed_error():
    backend = P.PrometheusBackend("http://127.0.0.1:9", timeout=1.0)
    with pytest.raises(BackendUnavailable) as info:
        backend.timeseries(60)
    assert info.value.what == "prometheus" and "prometheus unreachable" in str(info.value)
    backend.close()
