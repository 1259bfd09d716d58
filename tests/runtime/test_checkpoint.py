"""Checkpoints in one process: what a folder holds, the latest complete one, a checkpoint of another model, a changed
byte and a full disk."""

from __future__ import annotations

import contextlib
import errno
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from pyplan.errors import PlanError
from pyplan.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


@dataclass
class _Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict(keep_vars=True)


def _trained(model: nn.Module) -> _Trainer:
    trainer = _Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    model(torch.randn(3, 4)).square().sum().backward()
    trainer.optimizer.step()
    return trainer


def test_a_checkpoint_restores_parameters_buffers_and_optimizer_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = _trained(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    for step in (1, 2, 3):
        save_checkpoint(saved, step, tmp_path, keep=2)
    (tmp_path / "step-9.partial").mkdir()  # an interrupted save is not a checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3", "step-9.partial"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"
    assert latest_checkpoint(tmp_path / "none") is None

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    fresh = _Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    assert load_checkpoint(fresh, tmp_path / "step-3") == 3
    for name, t in saved.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], t), name
    assert fresh.optimizer.param_groups[0]["lr"] == 0.1  # the learning rate is the run's, not the checkpoint's
    for p, q in zip(saved.model.parameters(), fresh.model.parameters(), strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved.optimizer.state[p][key], fresh.optimizer.state[q][key]), key


def test_a_checkpoint_of_another_model_is_one_line(tmp_path: Path) -> None:
    save_checkpoint(_trained(nn.Sequential(nn.Linear(4, 4))), 1, tmp_path, keep=2)
    other = _trained(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(
        PlanError, match=r"cannot resume from checkpoint .*step-1': it has no '1\.(weight|bias)'; .*another model"
    ):
        load_checkpoint(other, tmp_path / "step-1")


def _flip_byte_of(folder: Path, values: torch.Tensor) -> str:
    """Flip the lowest byte of one of `values` where their bytes lie in a file of the checkpoint `folder`; the name
    of that file."""
    data = values.detach().numpy().tobytes()
    for file in sorted(folder.iterdir()):
        raw = bytearray(file.read_bytes())
        at = raw.find(data)
        if at >= 0:
            raw[at + 4 * 3] ^= 0x01  # the fourth value's lowest mantissa bit: a change of about 1e-7 of it
            file.write_bytes(bytes(raw))
            return file.name
    raise AssertionError("the tensor's bytes are in no file of the checkpoint")


def test_a_checkpoint_with_a_changed_byte_is_refused_in_one_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = _trained(nn.Sequential(nn.Linear(4, 4)))
    save_checkpoint(saved, 1, tmp_path, keep=2)
    save_checkpoint(saved, 2, tmp_path, keep=2)
    manifest = json.loads((tmp_path / "step-2" / "checksums.json").read_text())
    assert set(manifest["files"]) == {p.name for p in (tmp_path / "step-2").iterdir()} - {"checksums.json"}
    changed = _flip_byte_of(tmp_path / "step-2", saved.model[0].weight)
    fresh = _trained(nn.Sequential(nn.Linear(4, 4)))
    before = fresh.model[0].weight.detach().clone()
    with pytest.raises(PlanError) as refused:
        load_checkpoint(fresh, tmp_path / "step-2")
    assert str(refused.value) == (
        f"cannot resume from checkpoint '{tmp_path / 'step-2'}': {changed} does not match its SHA-256 in "
        "checksums.json (changed after it was saved); delete it to resume from the checkpoint before it, or give "
        "another --checkpoint folder"
    )
    assert torch.equal(fresh.model[0].weight, before)  # nothing was loaded from it
    assert load_checkpoint(fresh, tmp_path / "step-1") == 1  # an intact one loads
    assert torch.equal(fresh.model[0].weight, saved.model[0].weight)
    (tmp_path / "step-1" / "checksums.json").unlink()
    with pytest.raises(PlanError, match=r"step-1': it has no checksums.json \(saved by a pyplan without checksums"):
        load_checkpoint(fresh, tmp_path / "step-1")


class _FullDisk(io.RawIOBase):
    """A file on a disk with `room` bytes left: writes past it fail as the operating system fails them."""

    def __init__(self, stream: Any, room: list[int]) -> None:
        self.stream, self.room = stream, room

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.room[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room[0] -= size
        return self.stream.write(data)

    def tell(self) -> int:
        return self.stream.tell()


@pytest.fixture(params=["one process", "process group"])
def group(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    """Without a process group, and in a process group of one rank, where DCP sends each rank's failure pickled."""
    if request.param == "process group":
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.usefixtures("group")
@pytest.mark.parametrize("left", [0, 2000])  # full at the first write; inside torch.save's zip of a tensor
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, left: int
) -> None:
    torch.manual_seed(0)
    folder = tmp_path / "ckpt"
    saved = _trained(nn.Sequential(nn.Linear(4, 4)))
    save_checkpoint(saved, 1, folder, keep=1)
    write = FileSystem.create_stream
    room = [left]

    @contextlib.contextmanager
    def full(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with write(self, path, mode) as stream:
            yield _FullDisk(stream, room) if "w" in mode else stream

    monkeypatch.setattr(FileSystem, "create_stream", full)
    with pytest.raises(PlanError) as refused:
        save_checkpoint(_trained(nn.Sequential(nn.Linear(4, 4))), 2, folder, keep=1)
    assert str(refused.value) == (
        f"no space left on device for checkpoint '{folder}': step-2 was not saved, step-1 is kept as the latest; "
        "free space there or give another --checkpoint folder"
    )
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == ["step-1"]  # the cut-short save's folder removed
    fresh = _trained(nn.Sequential(nn.Linear(4, 4)))
    assert load_checkpoint(fresh, latest_checkpoint(folder)) == 1
    assert torch.equal(fresh.model[0].weight, saved.model[0].weight)
