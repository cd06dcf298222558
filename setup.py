"""Builds kvscope's compiled modules (Cython): the agent's fold, records and assembler.

Everything else about the package is in pyproject.toml.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

MODULES = ("requests", "assembler", "fold")

setup(ext_modules=cythonize(
    [Extension(f"kvscope.agent.{name}", [f"kvscope/agent/{name}.pyx"], extra_compile_args=["-O2"])
     for name in MODULES],
    compiler_directives={"language_level": 3},
))
