"""Builds kvscope's compiled modules (Cython): the agent's fold, records and assembler,
ingest's stall watch, and the block-hash sampling predicate the vLLM tap and the analysis share.

Everything else about the package is in pyproject.toml.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

MODULES = ("agent.requests", "agent.assembler", "agent.fold", "agent.sources.stalls", "sampling")

setup(ext_modules=cythonize(
    [Extension(f"kvscope.{name}", [f"kvscope/{name.replace('.', '/')}.pyx"],
               extra_compile_args=["-O2"])
     for name in MODULES],
    compiler_directives={"language_level": 3},
))
