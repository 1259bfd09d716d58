"""FLOPs of each block's forward and backward, counted by torch's FlopCounterMode on fake tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pyplan._torch import FLOP_FORMULAS, run_without_compute
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.profile.pieces import RepeatedBlocks, backward, block_inputs, forward, leaf_inputs

__all__ = ["block_flops"]


def _flops_at(
    chain: Chain, repeated: RepeatedBlocks, example_inputs: ExampleInputs, batch_size: int
) -> list[tuple[int, int]]:
    inputs = inputs_at(example_inputs, batch_size)
    mods = repeated.mods

    def count(convert: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[int, int]]:
        fwd_bwd = []
        done: dict[str, tuple[int, int]] = {}
        # The math kernel, because FlopCounterMode does not see inside CPU's fused attention kernel.
        with sdpa_kernel(SDPBackend.MATH):
            args = block_inputs(mods, [convert(t) for t in inputs], repeated)
            for i, (mod, a) in enumerate(zip(mods, args)):
                leaves = leaf_inputs(a, first=i == 0)
                key = repeated.key(i, leaves)
                if key is not None and key in done:
                    fwd_bwd.append(done[key])
                    continue
                with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as fwd:
                    _, roots = forward(mod, leaves)
                with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as bwd:
                    backward(roots)
                fwd_bwd.append((fwd.get_total_flops(), bwd.get_total_flops()))
                if key is not None:
                    done[key] = fwd_bwd[-1]
        return fwd_bwd

    return run_without_compute(chain.graph.module, count)


def block_flops(
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_sizes: Sequence[int] = (1, 2),
    *,
    blocks: RepeatedBlocks | None = None,
) -> list[tuple[Affine, Affine]]:
    """Forward and backward FLOPs of every block as `per_sample·b + fixed` (matmul/conv FLOPs, as torch counts);
    `blocks`: the chain's table of distinct blocks, when the caller has it already."""
    b1, b2 = batch_sizes[0], batch_sizes[-1]
    table = RepeatedBlocks.of(chain) if blocks is None else blocks
    f1, f2 = _flops_at(chain, table, example_inputs, b1), _flops_at(chain, table, example_inputs, b2)
    return [(Affine.from_two(b1, x[0], b2, y[0]), Affine.from_two(b1, x[1], b2, y[1])) for x, y in zip(f1, f2)]
