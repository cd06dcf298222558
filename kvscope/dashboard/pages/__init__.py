"""Dashboard pages; each module exposes ``layout(...)`` and ``register_callbacks(app, ...)``."""
