"""Training state on disk, over whatever a rank holds of the model.

A checkpoint is a `torch.distributed.checkpoint` (DCP) folder keyed by the original model's names: every parameter
and persistent buffer under each name it has (a tied weight under both), its optimizer state as
`optim.<name>.<key>`, and the training step. Sharded tensors (ZeRO-3's DTensors) are saved as their shards and
replicated ones once, as torchtitan saves; since nothing in it depends on the layout, a run resumes under another
plan of the same model (other dp, pp, micro-batches or ZeRO stage) and DCP reshards on load.

Folders are `step-<N>` inside the checkpoint directory, written as `step-<N>.partial` and renamed when every rank has
written its part: an interrupted save never looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from pyplan._torch import is_strided
from pyplan.errors import PlanError
from pyplan.runtime.master import MasterWeights
from pyplan.runtime.tensor_parallel import full_value, local_value

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

_STEP = re.compile(r"step-(\d+)")


class _Trainer(Protocol):
    """What a checkpoint needs of a trainer (PipelineTrainer, ShardedTrainer)."""

    optimizer: torch.optim.Optimizer

    def named_tensors(self) -> dict[str, torch.Tensor]: ...


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeRO-1's local optimizer over its shard of the parameters (the
    `optim` of a ZeroRedundancyOptimizer, not imported here: torch.distributed.optim warns on import)."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _state_dict(trainer: _Trainer, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The trainer's state keyed by the model's names; its tensors are the trainer's own (DCP loads in place),
    except those DCP cannot lay out (a fused QKV's strided shards), saved whole: returned a second time by key, the
    DTensors they stand for (`_put_back` copies what was loaded into them)."""
    tensors = trainer.named_tensors()
    names: dict[int, list[str]] = {}
    for name, t in tensors.items():
        names.setdefault(id(t), []).append(name)
    out: dict[str, Any] = {f"model.{name}": t for name, t in tensors.items()}
    optimizer = trainer.optimizer
    held = optimizer.master_state if isinstance(optimizer, MasterWeights) else _local_optimizer(optimizer).state
    for param, state in held.items():
        for name in names.get(id(param), []):
            for key, value in state.items():
                out[f"optim.{name}.{key}"] = value
    out["step"] = step
    strided = {k: v for k, v in out.items() if isinstance(v, DTensor) and any(map(is_strided, v.placements))}
    out.update({k: full_value(v).detach().clone() for k, v in strided.items()})
    return out, strided


def _put_back(state: dict[str, Any], strided: dict[str, torch.Tensor]) -> None:
    """Copy the whole tensors loaded for strided shards into this rank's shards."""
    with torch.no_grad():
        for key, held in strided.items():
            assert isinstance(held, DTensor)
            held.to_local().copy_(local_value(state[key], held))


def _init_optimizer_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Create the optimizer's state (it appears at the first step) without changing a parameter: one step at
    learning rate 0 on zero gradients. DCP then loads the saved state into it."""
    local = _local_optimizer(optimizer)
    if local.state:
        return
    # The outer optimizer's groups too: ZeRO-1 over DTensors and MasterWeights hand theirs to `local` at each step.
    groups = [*local.param_groups, *(optimizer.param_groups if optimizer is not local else [])]
    lrs = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = 0.0
    for p in params:
        if isinstance(optimizer, MasterWeights):
            optimizer.main_grad(p, create=True)  # its gradients are fp32 beside the 16-bit weights
        else:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()
    for group, lr in zip(groups, lrs, strict=True):
        group["lr"] = lr
    for p in params:
        p.grad = None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """DCP without a process group, quietly: it warns that it assumes one process, which is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_checkpoint(trainer: _Trainer, step: int, directory: str | Path, keep: int) -> Path:
    """Save the state after `step` optimizer steps as `directory/step-<step>`; keep the `keep` latest. Collective:
    every rank calls it."""
    directory = Path(directory)
    final = directory / f"step-{step}"
    partial = directory / f"step-{step}.partial"
    if _rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        except OSError as exc:
            raise PlanError(
                f"cannot write checkpoint '{directory}': {exc.strerror}; give a writable --checkpoint folder"
            ) from None
    _barrier()
    try:
        with _alone():
            dcp.save(_state_dict(trainer, step)[0], checkpoint_id=str(partial), no_dist=not dist.is_initialized())
    except (OSError, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
        raise PlanError(f"cannot write checkpoint '{partial}': {str(exc).splitlines()[0][:200]}") from None
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in _checkpoints(directory)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint of the most steps in `directory`, or None."""
    found = _checkpoints(Path(directory))
    return found[-1] if found else None


def load_checkpoint(trainer: _Trainer, path: str | Path) -> int:
    """Load the checkpoint at `path` into the trainer (resharding it to the trainer's layout); returns its step.
    Collective: every rank calls it."""
    params = [t for t in trainer.named_tensors().values() if isinstance(t, nn.Parameter)]
    unique = list({id(p): p for p in params}.values())
    _init_optimizer_state(trainer.optimizer, unique)
    state, strided = _state_dict(trainer, 0)
    try:
        with _alone():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        _put_back(state, strided)
    except (Exception, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
        missing = re.search(r"[Mm]issing key in checkpoint state_dict: ([\w.]+)", str(exc))
        what = (
            f"it has no '{missing.group(1).rstrip('.').removeprefix('model.')}'"
            if missing
            else str(exc).splitlines()[0][:200]
        )
        raise PlanError(
            f"cannot resume from checkpoint '{path}': {what}; it was saved for another model or optimizer "
            "(give another --checkpoint folder)"
        ) from None
    return int(state["step"])
