"""XLA:CPU flags (and a JAX setting, `ENV`) that only make the tests' small programs compile
faster, for the test process and every process it starts (a CLI run, a worker): no LLVM
optimisation passes, and the elemental emitters instead of the fusion emitters (about 3x less
compile time for the same values). Set where a test clears XLA_FLAGS so that the CLI sets up its
own devices.

Users compile with XLA's defaults: ``SHARDLIB_TEST_DEFAULT_FLAGS=1`` leaves these out everywhere
(`FAST` is empty), and `.ci/run` runs the structural and memory tests marked ``xla_defaults``
(matmul fusion, the remat ordering, the linear-memory bounds, layerwise) that way as well."""

import os

DEFAULTS = os.environ.get("SHARDLIB_TEST_DEFAULT_FLAGS") == "1"
FAST = "" if DEFAULTS else "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# Each op's MLIR location carries its own source line only, not the whole Python stack above it
# (JAX's default): the same programs, a tenth less tracing and compile time in the tests
# (`python -m pytest -n 0 tests/test_parity.py`: 99 -> 87 s and 109 -> 97 s of test time, the same
# 96 compiles). Set by tests/conftest.py for the test processes and every process they start.
ENV = {} if DEFAULTS else {"JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS": "0"}
