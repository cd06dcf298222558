"""The kvscope monitoring mixin: Grafana boards, recording rules and alerts, generated from
Python into ``grafana/`` (``python -m kvscope.mixin``).

Layout as in the monitoring-mixins convention: :mod:`config` (one overridable config object),
:mod:`rules`, :mod:`alerts`, :mod:`dashboards`, and :mod:`render` that writes the files.
"""

from kvscope.mixin.config import MixinConfig, MixinConfigError, load_config

__all__ = ["MixinConfig", "MixinConfigError", "load_config"]
