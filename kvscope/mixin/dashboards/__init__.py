"""The four boards, generated with grafana-foundation-sdk: file name -> dashboard JSON model."""

from __future__ import annotations

from kvscope.mixin.config import MixinConfig
from kvscope.mixin.dashboards.node import node
from kvscope.mixin.dashboards.overview import overview
from kvscope.mixin.dashboards.requests import requests
from kvscope.mixin.dashboards.tiers import tiers


def dashboards(cfg: MixinConfig) -> dict[str, dict]:
    return {
        "kvscope-overview.json": overview(cfg),
        "kvscope-tiers.json": tiers(cfg),
        "kvscope-requests.json": requests(cfg),
        "kvscope-node.json": node(cfg),
    }
