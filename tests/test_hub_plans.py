"""Hugging Face models from tiny configs: captured with a cut before every layer, planned for this machine and for
a catalog GPU. (Their training under torchrun is in tests/runtime/_transparency.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pyplan import linearize, load_model, search, trace
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from tests.conftest import write_local_calibration
from tests.test_hub import REFS

pytest.importorskip("transformers")

# The module path of each family's repeated layer: a chain must cut before every one of them.
LAYERS = {
    "gpt2": r"transformer\.h\.(\d+)",
    "bert": r"bert\.encoder\.layer\.(\d+)",
    "llama": r"model\.layers\.(\d+)",
    "mixtral": r"model\.layers\.(\d+)",
    "t5": r"model\.(?:encoder|decoder)\.block\.(\d+)",
    "vit": r"vit\.(?:encoder\.)?layers?\.(\d+)",
}


@pytest.fixture(scope="module")
def local_calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    write_local_calibration(cache)
    return cache


@pytest.mark.parametrize("family", list(REFS))
def test_a_cut_before_every_layer_and_plans_for_local_and_a100(
    family: str, local_calibration: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(local_calibration))
    spec = load_model(REFS[family])
    torch.manual_seed(0)
    model = spec.build()
    chain = linearize(trace(model, spec.example_inputs, batch_size=2))
    # Where each layer's first block starts: a cut, with only tensors live across it.
    starts: dict[str, int] = {}
    for k, block in enumerate(chain.blocks):
        match = re.match(LAYERS[family], block.name)
        if match:
            starts.setdefault(match.group(0), k)
    assert len(starts) == (4 if family == "t5" else 2), [b.name for b in chain.blocks]  # 2 layers (t5: each side)
    for k in starts.values():
        assert all(chain.graph.node(v).is_tensor for v in chain.cuts[k].live)
    options = dict(loss=spec.loss, target=spec.target, stage_dag=False, micro_batch_sizes=[2])
    local = search(model, spec.example_inputs, Cluster.from_catalog("local", 2), Workload(global_batch=4), **options)
    assert local.best.predicted.iteration_s > 0 and local.profiled_on == "measured on this machine"
    with torch.device("meta"):
        meta = spec.build()
    catalog = search(meta, spec.example_inputs, Cluster.from_catalog("a100-80g", 4), Workload(global_batch=8),
                     **options)  # fmt: skip
    assert catalog.best.predicted.iteration_s > 0 and catalog.profiled_on.startswith("analytic")
