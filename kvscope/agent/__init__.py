"""The node agent: sources -> pipeline -> sinks, collectors, HTTP API."""
