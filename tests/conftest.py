"""Every test sees 8 simulated CPU devices, set before JAX initialises its backend."""
import os

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        # A loaded 2-core machine can leave some device threads late to a collective;
        # the default 40 s watchdog would then abort the process (see DESIGN.md).
        "--xla_cpu_collective_call_terminate_timeout_seconds=900",
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
