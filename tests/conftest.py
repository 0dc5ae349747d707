"""Every test sees 8 simulated CPU devices, set before JAX initialises its backend."""
import os

from tests import compile_flags

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        # A loaded 2-core machine can leave some device threads late to a collective;
        # the default 40 s watchdog would then abort the process (docs/design.md, "The CPU collective watchdog").
        "--xla_cpu_collective_call_terminate_timeout_seconds=900",
        # Tests are dominated by compilation of small programs (`tests/compile_flags.py`); no
        # test's reference changes (each comparison runs both sides under the same flags).
        compile_flags.FAST,
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
for name, value in compile_flags.ENV.items():
    os.environ.setdefault(name, value)
# The TPU-compilation tests in both workers load libtpu, whose lockfile admits one process
# (`shardlib.runtime.devices.topology_devices`; no chip is touched).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# `shardlib plan` keeps compiles in a cache folder; the tests compile afresh (and write nothing home).
os.environ["SHARDLIB_PLAN_CACHE"] = "none"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
