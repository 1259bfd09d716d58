"""Checkpoints in one process: what a folder holds, the latest complete one, and a checkpoint of another model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

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
