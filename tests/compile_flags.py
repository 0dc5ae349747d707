"""XLA:CPU flags (and a JAX setting, `ENV`) that only make the tests' small programs compile
faster, for the test process and every process it starts (a CLI run, a worker): no LLVM
optimisation passes, the elemental emitters instead of the fusion emitters (about 3x less
compile time for the same values), and one LLVM module a program (below). Set where a test
clears XLA_FLAGS so that the CLI sets up its own devices.

Users compile with XLA's defaults: ``SHARDLIB_TEST_DEFAULT_FLAGS=1`` leaves these out everywhere
(`FAST` is empty), and `.ci/run` runs the structural and memory tests marked ``xla_defaults``
(matmul fusion, the remat ordering, the linear-memory bounds, layerwise) that way as well."""

import os

DEFAULTS = os.environ.get("SHARDLIB_TEST_DEFAULT_FLAGS") == "1"
# XLA:CPU splits a program's LLVM module in parts to compile them on parallel threads; the suite's
# two processes already fill both cores, so the split only adds work: one part, about a sixth less
# compile CPU (the tiny GPT's init and step programs of dp, zero1, zero3 and tp, compiled in one
# process: 5.1-6.2 -> 4.1-4.6 CPU s; `python -m pytest -n 0 tests/test_parity.py
# tests/test_local_sgd.py`: 89.7 -> 85.2 CPU s, user + system).
FAST = "" if DEFAULTS else ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                            "--xla_cpu_parallel_codegen_split_count=1")
# Each op's MLIR location carries its own source line only, not the whole Python stack above it
# (JAX's default): the same programs, a tenth less tracing and compile time in the tests
# (`python -m pytest -n 0 tests/test_parity.py`: 99 -> 87 s and 109 -> 97 s of test time, the same
# 96 compiles). Set by tests/conftest.py for the test processes and every process they start.
ENV = {} if DEFAULTS else {"JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS": "0"}
