"""XLA:CPU flags that only make the tests' small programs compile faster, for the test process
and every process it starts (a CLI run, a worker): no LLVM optimisation passes, and the
elemental emitters instead of the fusion emitters (about 3x less compile time for the same
values). Set where a test clears XLA_FLAGS so that the CLI sets up its own devices."""

FAST = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
