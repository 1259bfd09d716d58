"""The plans the `pyplan emit --format` tests export: a small Llama and GPT-2 planned once per session, and variants
of them (the plan document with fields replaced). Shared by the test_configs*.py files; holds no test."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pyplan.cli.main import main
from pyplan.emit.planfile import PlanFile, plan_file_from_json
from pyplan.errors import PlanError

__all__ = ["LLAMA", "PLANS", "Plans", "plans", "refusal"]

# A Llama in torchtitan's names (pyplan.zoo.transformer.Llama), 8 layers. `pyplan inspect` numbers its blocks:
# tok_embeddings is block 0 and layer k starts at block 1 + 6k, so `--cuts 25` starts a stage at layers.4.
LLAMA = """
import torch
from torch.nn import functional as F

from pyplan.zoo.transformer import Llama, LlamaConfig

CFG = LlamaConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=32)


def model():
    return Llama(CFG)


def example_inputs(batch_size):
    return (torch.randint(0, CFG.vocab_size, (batch_size, CFG.max_seq_len)),)


def target(batch_size):
    return torch.randint(0, CFG.vocab_size, (batch_size, CFG.max_seq_len))


def loss(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())
"""

# Each plan: the model ("llama" or a zoo reference) and the pins.
PLANS: dict[str, tuple[str, str]] = {
    # Two stages starting at tok_embeddings and layers.4, 1F1B over 4 micro-batches, every block recomputed.
    "pipeline": (
        "llama",
        "--gpus 2 --pp 2 --dp 1 --schedule 1F1B --ga 4 --micro-batch 4 --zero 0 --remat full --precision fp32 "
        "--cuts 25",
    ),
    # Two ranks of two stages each (layers 0-1, 2-3, 4-5, 6-7), interleaved.
    "interleaved": (
        "llama",
        "--gpus 2 --pp 2 --dp 1 --schedule Interleaved1F1B --ga 4 --micro-batch 4 --zero 0 --precision fp32 "
        "--cuts 13,25,37",
    ),
    # Two ranks of three stages each (layers 0, 1, 2-3, 4, 5-6, 7), interleaved: Megatron's virtual stages, uneven.
    "interleaved3": (
        "llama",
        "--gpus 2 --pp 2 --dp 1 --schedule Interleaved1F1B --chunks 3 --ga 4 --micro-batch 4 --zero 0 --precision fp32 "
        "--cuts 7,13,25,31,43",
    ),
    # dp 2 x tp 2, ZeRO-3, bf16 autocast.
    "tensor": ("llama", "--gpus 4 --tp 2 --dp 2 --pp 1 --zero 3 --precision bf16-mixed"),
    # dp 4, ZeRO-1, bf16 weights beside fp32 master weights.
    "replicas": ("llama", "--gpus 4 --dp 4 --pp 1 --zero 1 --precision bf16-master"),
    # One GPU, torchtitan's selective checkpointing.
    "selective": ("llama", "--gpus 1 --remat selective --precision bf16-mixed --micro-batch 8"),
    # GPT-2 (tied embeddings), dp 2.
    "gpt": ("zoo:gpt-tiny", "--gpus 2 --dp 2 --pp 1 --zero 0 --precision bf16-mixed"),
}


class Plans:
    """The plans of PLANS, planned once each, and variants of them (the plan document with fields replaced)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.llama = folder / "llama.py"
        self.llama.write_text(LLAMA)
        self._docs: dict[str, dict[str, Any]] = {}

    def json(self, name: str) -> dict[str, Any]:
        if name not in self._docs:
            model, pins = PLANS[name]
            out = self.folder / f"{name}.json"
            ref = str(self.llama) if model == "llama" else model
            argv = ["plan", ref, "--gpu", "a100-80g", "--global-batch", "16", "--json", *pins.split()]
            argv += ["--out", str(out)]
            assert main(argv) == 0, name
            self._docs[name] = json.loads(out.read_text())
        return json.loads(json.dumps(self._docs[name]))

    def doc(
        self, name: str, *, precision: str | None = None, global_batch: int | None = None, **layout: Any
    ) -> PlanFile:
        """Plan `name`, with the workload's precision or global batch and the layout's fields replaced where given."""
        data = self.json(name)
        if precision is not None:
            data["workload"]["precision"] = precision
        if global_batch is not None:
            data["workload"]["global_batch"] = global_batch
        data["plan"].update(layout)
        return plan_file_from_json(data, name)

    def path(self, name: str, **changes: Any) -> Path:
        """A plan file of `doc(name, **changes)`."""
        data = self.json(name)
        if "precision" in changes:
            data["workload"]["precision"] = changes.pop("precision")
        data["plan"].update(changes)
        out = self.folder / f"{name}-{abs(hash(json.dumps(changes, sort_keys=True)))}.json"
        out.write_text(json.dumps(data))
        return out


@pytest.fixture(scope="session")
def plans(tmp_path_factory: pytest.TempPathFactory) -> Plans:
    return Plans(tmp_path_factory.mktemp("config-plans"))


def refusal(call: Callable[[], object]) -> str:
    """The one-line message of the PlanError `call` raises."""
    with pytest.raises(PlanError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message
