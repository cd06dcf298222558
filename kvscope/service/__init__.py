"""The running agent: wires the data path (``agent/``) to its sinks (``exporter/``, the HTTP API),
serves it and owns its lifecycle."""
