"""Builds kvscope's compiled modules (Cython): the agent's fold, records and assembler,
ingest's stall watch, the block-hash sampling predicate the vLLM tap and the analysis share, and
the vLLM tap's scheduler side.

Everything else about the package is in pyproject.toml.
"""

from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

MODULES = ("agent.requests", "agent.assembler", "agent.fold", "agent.sources.stalls", "sampling")
# Plain Python modules compiled as they are, for speed only, where the .py runs if the compiled
# module is not built: those whose first line is a Cython directive comment (``# cython: ...``).
# The vLLM tap's scheduler side (agent/taps/vllm_manager.py) is one: it runs on vLLM's scheduler
# thread at each of its calls, and compiled it costs bench/tap_overhead.py's ``connector``
# sequence a quarter less; its .pxd makes its observer an extension type with C fields (3 us a
# request less again, of 14).
COMPILED_PY = sorted(str(path.with_suffix("")).replace("/", ".")[len("kvscope."):]
                     for path in Path("kvscope").rglob("*.py")
                     if path.read_text().startswith("# cython:"))

setup(ext_modules=cythonize(
    [Extension(f"kvscope.{name}", [f"kvscope/{name.replace('.', '/')}{suffix}"],
               extra_compile_args=["-O2"])
     for names, suffix in ((MODULES, ".pyx"), (COMPILED_PY, ".py")) for name in names],
    compiler_directives={"language_level": 3},
))
