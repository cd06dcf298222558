"""Sinks that encode what the agent holds: the Prometheus exposition (``prometheus.py``) and
OpenTelemetry span export (``otlp.py``)."""
