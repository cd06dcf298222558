"""Dashboard callback time per page, with 100,000 requests in the agent's table and an hour of
one-second samples. Goal: p95 under 200 ms per page on this machine.

A real agent API (FastAPI on a loopback port) serves a pipeline filled with 100,000 finished
requests (each with a lookup and two transfers) spread over 3,600 one-second samples. Each
page's callbacks run through Dash's own HTTP endpoint (``/_dash-update-component``, via the
Flask test client), so the time includes the agent read, the figure building and Dash's JSON
encoding — what a browser waits for. The dashboard's window is one hour, so all 3,600 samples
are drawn (thinned to 720 points per series). Sample reads after the first are incremental
(``since``); the first, cold read of the hour is reported on its own.

Run: python bench/dashboard.py [--requests N] [--seconds S] [--repeat R]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from kvscope import events as ev
from kvscope.agent.config import AgentSettings
from kvscope.dashboard.app import create_app
from kvscope.service.agent import Agent
from kvscope.service.api import create_app as create_api
from kvscope.service.server import ApiServer, bind

T0 = 1764410000.0
TRACE = os.path.join(os.environ.get("KVSCOPE_TRACE_DIR", os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "traces")), "mooncake_conversation_trace.jsonl")


def fill(agent: Agent, requests: int, seconds: int) -> str:
    """Feed ``requests`` requests over ``seconds`` samples; return one request id."""
    rng = random.Random(0)
    pipe = agent.pipeline
    per_second = requests / seconds
    done = 0
    for sec in range(seconds):
        now = T0 + sec
        batch = []
        target = round((sec + 1) * per_second)
        while done < target:
            rid = f"r{done}"
            ttft = rng.lognormvariate(-3, 0.8)
            batch += [
                ev.RequestStarted(ts=now, request_id=rid, prompt_tokens=2048),
                ev.Lookup(ts=now, request_id=rid, blocks=128, block_hits={"gpu": 40, "cpu": 30},
                          tokens={"gpu": 640, "cpu": 480, "recompute": 928}),
                ev.Transfer(ts=now + 0.001, src="cpu", dst="gpu", blocks=30, bytes=30 << 17,
                            duration=rng.uniform(5e-4, 5e-3), request_id=rid),
                ev.Transfer(ts=now + 0.002, src="gpu", dst="cpu", blocks=20, bytes=20 << 17,
                            duration=rng.uniform(2e-4, 2e-3), request_id=rid),
                ev.Eviction(ts=now, tier="gpu", blocks=20, bytes=20 << 17, age=rng.uniform(1, 60),
                            hits=rng.randint(0, 3), offloaded=True),
                ev.Eviction(ts=now, tier="cpu", blocks=10, bytes=10 << 17,
                            age=rng.uniform(10, 600), hits=rng.randint(0, 2)),
                ev.RequestFinished(ts=now + ttft, request_id=rid, ttft=ttft, prompt_tokens=2048,
                                   queueing=ttft * 0.1, lookup=ttft * 0.05,
                                   promotion_wait=ttft * 0.2, prefill=ttft * 0.65),
            ]
            done += 1
        for tier, cap in (("gpu", 1 << 30), ("cpu", 8 << 30)):
            batch.append(ev.TierSnapshot(ts=now, tier=tier, capacity_bytes=cap,
                                         resident_bytes=int(cap * 0.9), capacity_blocks=cap >> 17,
                                         resident_blocks=int((cap >> 17) * 0.9)))
        pipe.ingest("engine", batch)
        pipe.record_sample(now, 20e9 - sec * 1e6, host_memory_reserve=4e9,
                           host_memory_headroom=16e9 - sec * 1e6, offload_budgets={"cpu": 8 << 30},
                           pcie_link_max={"0": 31.5e9})
    return "r0"


def payload(app, key: str, values: dict) -> dict:
    """The body a browser posts for callback ``key``, with ``values`` for its inputs/states."""
    cb = app.callback_map[key]

    def prop(d):
        return {"id": d["id"], "property": d["property"],
                "value": values.get(f"{d['id']}.{d['property']}")}

    outputs = [{"id": o.split(".")[0], "property": o.split(".")[1]}
               for o in key.strip(".").split("...")]
    return {"output": key, "outputs": outputs if len(outputs) > 1 else outputs[0],
            "inputs": [prop(i) for i in cb["inputs"]], "state": [prop(s) for s in cb["state"]],
            "changedPropIds": ["refresh.n_intervals"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--seconds", type=int, default=3600)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--sizing-trace", default=TRACE if os.path.isfile(TRACE) else None,
                        help="trace for the Sizing page (default: the shared Mooncake trace)")
    args = parser.parse_args()

    agent = Agent(AgentSettings(requests_capacity=max(args.requests, 1)), with_ingest=False)
    t = time.perf_counter()
    rid = fill(agent, args.requests, args.seconds)
    print(f"filled: {len(agent.pipeline.requests):,} requests, "
          f"{len(agent.pipeline.samples()):,} samples in {time.perf_counter() - t:.1f} s")
    sock = bind("127.0.0.1", 0, "--port")
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = ApiServer(create_api(agent), sock)
    server.start()
    try:
        app = create_app(url, window_seconds=float(args.seconds), sizing_trace=args.sizing_trace)
        sizing = app.kvscope.sizing.wait(120)
        print(f"sizing page: {sizing.status} ({args.sizing_trace or 'no trace'})")
        client = app.server.test_client()
        values = {"refresh.n_intervals": 1, "instance.value": None, "requests-limit.value": 500,
                  "requests-sort.data": [], "min-ttft.value": None,
                  "url.search": f"?id={rid}"}
        keys = {page: next(k for k in app.callback_map if marker in k) for page, marker in (
            ("overview", "overview-status.children"), ("tiers", "tiers-status.children"),
            ("requests: table", "requests-status.children"),
            ("requests: waterfall", "waterfall.figure"), ("sizing", "sizing-status.children"))}

        def call(key):
            start = time.perf_counter()
            response = client.post("/_dash-update-component",
                                   data=json.dumps(payload(app, key, values)),
                                   content_type="application/json")
            elapsed = time.perf_counter() - start
            assert response.status_code == 200, response.data[:300]
            return elapsed, len(response.data)

        cold, size = call(keys["overview"])
        print(f"first Overview refresh (cold: reads the hour of samples): {cold * 1000:.0f} ms, "
              f"{size / 1e6:.1f} MB response")
        print(f"{'page callback':24} {'p50 ms':>8} {'p95 ms':>8} {'response':>10}")
        worst = 0.0
        for page, key in keys.items():
            times = []
            for _ in range(args.repeat):
                elapsed, size = call(key)
                times.append(elapsed * 1000)
            times.sort()
            p50 = statistics.median(times)
            p95 = times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
            worst = max(worst, p95)
            print(f"{page:24} {p50:8.1f} {p95:8.1f} {size / 1e3:8.0f} kB")
        print(f"worst p95 {worst:.0f} ms; goal < 200 ms: {'met' if worst < 200 else 'NOT met'}")
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
