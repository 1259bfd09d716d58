"""Training state on disk, over whatever a rank holds of the model.

A checkpoint is a `torch.distributed.checkpoint` (DCP) folder keyed by the original model's names: every parameter
and persistent buffer under each name it has (a tied weight under both), its optimizer state as
`optim.<name>.<key>`, and the training step. Sharded tensors (ZeRO-3's DTensors) are saved as their shards and
replicated ones once, as torchtitan saves; since nothing in it depends on the layout, a run resumes under another
plan of the same model (other dp, pp, micro-batches or ZeRO stage) and DCP reshards on load.

Folders are `step-<N>` inside the checkpoint directory, written as `step-<N>.partial` and renamed when every rank has
written its part: an interrupted save never looks like a checkpoint. The last file written into it is `checksums.json`,
the SHA-256 and size of every other file, checked before a checkpoint is loaded: a changed byte is refused in one line
naming the file, never trained on. The ranks hash the files in turns (file i on rank i mod world size), so the folder
must be one that every rank reads, as loading under another plan already needs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
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
_MANIFEST = "checksums.json"


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


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, whose failures keep what the operating system said. torch.save turns a failed write into
    a RuntimeError ("unexpected pos ...") over the OSError, and DCP sends a rank's failure to the others pickled,
    without that context: the OSError itself is raised instead."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except Exception as exc:
            found = _os_error(exc)
            if found is None or found is exc:
                raise
            raise OSError(found.errno, found.strerror, found.filename) from None


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError under `exc`: itself, a failure of a rank inside DCP's CheckpointException, or the error that an
    exception was raised while handling."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        e = pending.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, dcp.CheckpointException):
            pending += [failure for failure, _ in e.failures.values()]
        pending += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def _first_line(exc: BaseException) -> str:
    """The first line of what went wrong: under DCP's CheckpointException, its first failing rank's error (its own
    first line says only "CheckpointException ranks:dict_keys([1])")."""
    if isinstance(exc, dcp.CheckpointException) and exc.failures:
        failure = next(iter(exc.failures.values()))[0]
        return f"{type(failure).__name__}: {_first_line(failure)}"
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def _save_failure(exc: BaseException, directory: Path, step: int) -> str:
    """One line for a save that failed: what the operating system said, or DCP's first line, with the checkpoint
    that is still the latest."""
    latest = latest_checkpoint(directory)
    kept = f"{latest.name} is kept as the latest" if latest is not None else "there is no earlier checkpoint"
    found = _os_error(exc)
    if found is not None and found.errno == errno.ENOSPC:
        return (
            f"no space left on device for checkpoint '{directory}': step-{step} was not saved, {kept}; free space "
            "there or give another --checkpoint folder"
        )
    what = (found.strerror or str(found)).lower() if found is not None else _first_line(exc)
    return (
        f"cannot write checkpoint '{directory / f'step-{step}'}': {what}; {kept}; give a writable --checkpoint folder"
    )


def _gathered(value: Any) -> list[Any]:
    """`value` of every rank, in rank order. Collective."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _raise_first(problem: BaseException | None) -> None:
    """Raise the first rank's `problem` on every rank, if any rank has one: no rank goes on to wait in a collective
    for one that stopped. Collective."""
    first = next((p for p in _gathered(problem) if p is not None), None)
    if first is not None:
        raise first


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _my_turn(index: int) -> bool:
    """Whether this rank hashes file number `index` of a checkpoint: the ranks take the files in turns."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return index % world == _rank()


def _write_manifest(folder: Path) -> None:
    """Write `checksums.json` into `folder`, last: the size and SHA-256 of every file DCP wrote there, each hashed
    by one rank, written by rank 0 through a temporary file. Collective; a failure is an OSError on every rank."""
    names = [sorted(p.name for p in folder.iterdir() if p.is_file()) if _rank() == 0 else []]
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0)
    mine: dict[str, dict[str, Any]] = {}
    error = None
    try:
        for i, name in enumerate(names[0]):
            if _my_turn(i):
                mine[name] = {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
    except OSError as exc:
        error = OSError(exc.errno, exc.strerror or str(exc), exc.filename)  # picklable: no traceback
    _raise_first(error)
    files = {name: entry for part in _gathered(mine) for name, entry in part.items()}
    if _rank() == 0:
        manifest = json.dumps({"algorithm": "sha256", "files": dict(sorted(files.items()))}, indent=1) + "\n"
        tmp = folder / f".{_MANIFEST}.tmp"
        try:
            with tmp.open("w") as f:
                f.write(manifest)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder / _MANIFEST)
        except OSError as exc:
            error = OSError(exc.errno, exc.strerror or str(exc), exc.filename)
    _raise_first(error)


def _manifest_files(path: Path) -> dict[str, dict[str, Any]]:
    """The files a checksums.json lists, each with its "bytes" and "sha256"; a ValueError where it lists none such."""
    files = json.loads(path.read_text())["files"]
    if not isinstance(files, dict) or not all(
        Path(name).name == name
        and isinstance(v, dict)
        and isinstance(v.get("bytes"), int)
        and isinstance(v.get("sha256"), str)
        for name, v in files.items()
    ):
        raise ValueError("its files are not each a name with bytes and sha256")
    return files


def _verify(path: Path) -> None:
    """Check every file of the checkpoint at `path` against its checksums.json (each file by one rank) before
    anything is loaded from it; a missing, shortened or changed file is one line naming it. Collective."""
    fix = "delete it to resume from the checkpoint before it, or give another --checkpoint folder"
    found: list[Any] = [None]
    if _rank() == 0:
        try:
            found[0] = _manifest_files(path / _MANIFEST)
        except FileNotFoundError:
            found[0] = f"it has no {_MANIFEST} (saved by a pyplan without checksums, or changed by hand); {fix}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            found[0] = f"its {_MANIFEST} cannot be read ({str(exc).splitlines()[0][:100]}); {fix}"
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    files = found[0]
    problem = None
    if isinstance(files, str):
        problem = files
    else:
        for i, (name, want) in enumerate(sorted(files.items())):
            if not _my_turn(i):
                continue
            try:
                size = (path / name).stat().st_size
                if size != want["bytes"]:
                    problem = f"{name} holds {size} bytes, {_MANIFEST} says {want['bytes']}; {fix}"
                elif _sha256(path / name) != want["sha256"]:
                    problem = f"{name} does not match its SHA-256 in {_MANIFEST} (changed after it was saved); {fix}"
            except OSError as exc:
                problem = f"{name} cannot be read ({(exc.strerror or str(exc)).lower()}); {fix}"
            if problem:
                break
    first = next((p for p in _gathered(problem) if p), None)
    if first is not None:
        raise PlanError(f"cannot resume from checkpoint '{path}': {first}")


def save_checkpoint(trainer: _Trainer, step: int, directory: str | Path, keep: int) -> Path:
    """Save the state after `step` optimizer steps as `directory/step-<step>`; keep the `keep` latest. Collective:
    every rank calls it. A failed save (a full disk) is one line; the folder it left is removed and the checkpoints
    before it are kept."""
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
            dcp.save(_state_dict(trainer, step)[0], storage_writer=_Writer(partial), no_dist=not dist.is_initialized())
        _write_manifest(partial)
    except (OSError, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # what the cut-short save took, on a disk that may be full
        raise PlanError(_save_failure(exc, directory, step)) from None
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
    Collective: every rank calls it. The files are checked against the checkpoint's checksums first."""
    _verify(Path(path))
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
        what = f"it has no '{missing.group(1).rstrip('.').removeprefix('model.')}'" if missing else _first_line(exc)
        raise PlanError(
            f"cannot resume from checkpoint '{path}': {what}; it was saved for another model or optimizer "
            "(give another --checkpoint folder)"
        ) from None
    return int(state["step"])
