"""The one thing pyproject.toml cannot say: the relay's compiled core (prefill_gate/proxy/_relaycore.c) is
built where a C compiler is at hand and skipped where not (``optional``): the proxy then runs
the Python path, which behaves alike (prefill_gate/proxy/relaycore.py; ``relay_core`` setting)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("prefill_gate.proxy._relaycore", ["prefill_gate/proxy/_relaycore.c"], optional=True,
                             extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter",
                                                 "-Wno-missing-field-initializers", "-Wno-cast-function-type"])])
