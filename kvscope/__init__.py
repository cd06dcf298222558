"""kvscope: observability for KV-cache offload in LLM serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvscope")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
