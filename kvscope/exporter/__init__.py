"""The exporter: metric catalog and the Prometheus collector."""
