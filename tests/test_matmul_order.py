"""Weight gradients reach their reduction in the order their matmul writes them.

A Dense kernel ``[in, out]``'s gradient is JAX's transpose of the matmul ``dy^T x`` (``[out,
in]``). Reduced as ``[in, out]``, XLA:CPU computes that matmul from two transposed operands,
which its fused dot kernel refuses: it runs unfused, as Eigen tasks on the thread pool, the few %
the step cost over plain ``jax.jit`` on 2 cores (BENCHMARKS.md). dp reduces the matrix
transposed, zero1/zero2 split the state on the kernel's last dim (`Strategy.state_from_last`),
and ZeRO-3's gathers reduce-scatter a copy in the matmul's order (`hooks.matmul_ordered`). The
reference is the old order: 7 of the tiny GPT's matmuls unfused under each of these strategies.
"""

import pytest

from shardlib import build, make_layout, make_mesh
from shardlib.tools.hlo_parse import unfused_dots
from tests.helpers import batches, optimizer, tiny_model


@pytest.mark.xla_defaults
@pytest.mark.parametrize("strategy, mesh", [("dp", {"data": 8}), ("zero1", {"data": 8}), ("hsdp", {"data": 2, "fsdp": 4})])
def test_every_matmul_of_the_step_is_fused_on_cpu(strategy, mesh):
    model = tiny_model()
    program = build(model, optimizer(), make_layout(model, strategy, make_mesh(mesh)))
    compiled = program.compile_step(program.abstract_state(), batches(1)[0])  # no init program to compile
    assert unfused_dots(compiled) == 0
