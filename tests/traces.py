"""Where the shared real traces live: $KVSCOPE_TRACE_DIR, else ../shared/traces beside the repo."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE_DIR = Path(os.environ.get("KVSCOPE_TRACE_DIR", ROOT.parent / "shared" / "traces"))


def trace_path(name: str = "mooncake_conversation_trace.jsonl") -> Path:
    """The trace's path; skips the calling test with the reason when the file is absent."""
    path = TRACE_DIR / name
    if not path.is_file():
        pytest.skip(f"trace {path} not found (set KVSCOPE_TRACE_DIR)")
    return path
