"""Run under torchrun (2 ranks): the model state each rank holds after a step, per ZeRO stage and precision.

Rank 0 writes {"<zero>/<precision>": [held bytes of rank 0, of rank 1, ...]} to argv[1]: the unique storages of the
rank's parameters, gradients and optimizer state (local shards of sharded tensors)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from pyplan import cut_points, load_model, trace
from pyplan.graph.trace import call_at, input_tensors
from pyplan.plan import Layout
from pyplan.runtime.trainer import build_trainer, optimizer_factory, replica_slice

MODEL, BATCH, MICRO = "zoo:gpt-tiny", 8, 2


def _held(tensors: list[torch.Tensor]) -> int:
    storages: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spec = load_model(MODEL)
    end = len(cut_points(trace(spec.build(), spec.example_inputs, batch_size=MICRO)).order)
    call, target = call_at(spec.example_inputs, BATCH), spec.target(BATCH)
    held = {}
    for precision in ("fp32", "bf16-mixed"):
        for zero in (0, 1, 3):
            layout = Layout(dp=2, pp=1, micro_batch_size=MICRO, num_microbatches=BATCH // (2 * MICRO), schedule="1F1B",
                            cut_positions=(0, end), zero_stage=zero)  # fmt: skip
            torch.manual_seed(0)
            trainer = build_trainer(spec, spec.build(), layout, optimizer_factory("adamw", 1e-3), precision=precision)
            mine = replica_slice(layout, trainer.dp_rank)
            trainer.step(tuple(t[mine] for t in input_tensors(call)), target[mine])
            params = list({id(p): p for m in trainer.modules for p in m.parameters()}.values())
            optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeroRedundancyOptimizer's own
            state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            grads = [p.grad for p in params if p.grad is not None]
            held[f"{zero}/{precision}"] = _held(params) + _held(grads) + _held(state)
    everyone: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({k: [h[k] for h in everyone] for k in held}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
