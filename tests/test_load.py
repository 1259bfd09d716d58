"""Model references: files, `file.py:function`, `zoo:NAME`, and the errors for each way they go wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pyplan import ModelLoadError, TraceError, load_model, trace
from tests.conftest import EXAMPLES


def _write(tmp_path: Path, text: str, name: str = "m.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_loads_a_model_file() -> None:
    spec = load_model(os.path.join(EXAMPLES, "mlp.py"))
    assert spec.name == "mlp.py" and spec.loss is not None and spec.target is not None
    assert spec.build()(*spec.example_inputs(3)).shape == (3, 10)


def test_loads_file_colon_function(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "import torch\n"
        "def wide():\n    return torch.nn.Linear(4, 8)\n"
        "def example_inputs(b):\n    return (torch.randn(b, 4),)\n",
    )
    spec = load_model(f"{path}:wide")
    assert spec.build().out_features == 8 and spec.loss is None


def test_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope.py"))


def test_file_without_model_shows_the_expected_shape(tmp_path: Path) -> None:
    path = _write(tmp_path, "x = 1\n")
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    msg = str(info.value)
    assert "defines no model()" in msg and "def example_inputs(batch_size: int)" in msg and "\n" not in msg


def test_file_that_fails_to_import(tmp_path: Path) -> None:
    path = _write(tmp_path, "import not_a_real_module_xyz\n")
    with pytest.raises(ModelLoadError, match=r"importing .* failed with ModuleNotFoundError"):
        load_model(path)


def test_model_that_returns_no_module(tmp_path: Path) -> None:
    path = _write(tmp_path, "def model():\n    return 3\ndef example_inputs(b):\n    return ()\n")
    with pytest.raises(ModelLoadError, match=r"model\(\) returned int, not an nn.Module"):
        load_model(path).build()


def test_example_inputs_that_raise(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "import torch\ndef model():\n    return torch.nn.Linear(2, 2)\n"
        "def example_inputs(b):\n    raise ValueError('dataset missing')\n",
    )
    spec = load_model(path)
    with pytest.raises(TraceError, match=r"example_inputs.*raised ValueError: dataset missing"):
        trace(spec.build(), spec.example_inputs)


def test_untraceable_model_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "import torch\n"
        "class Gate(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x if x.max() > 0 else -x\n"
        "def model():\n    return torch.nn.Sequential(torch.nn.Linear(2, 2), Gate())\n"
        "def example_inputs(b):\n    return (torch.randn(b, 2),)\n",
    )
    spec = load_model(path)
    with pytest.raises(TraceError, match=r"module '1' \(Gate\).*--leaf Gate"):
        trace(spec.build(), spec.example_inputs)
    graph = trace(spec.build(), spec.example_inputs, leaf_modules=["Gate"])
    assert any(n.target == "1" for n in graph.nodes)
    assert isinstance(graph.module(torch.randn(1, 2)), torch.Tensor)


def test_a_model_file_that_exits_at_import_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "script.py"
    path.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ModelLoadError, match=r"called sys.exit\(0\); put the file's script part under"):
        load_model(str(path))


REAL = os.path.join(os.path.dirname(__file__), "models", "real")


def test_a_transformers_model_file_builds_without_its_cache() -> None:
    pytest.importorskip("transformers")
    spec = load_model(os.path.join(REAL, "hf_cache.py"))
    model = spec.build()
    configs = [m.config for m in model.modules() if hasattr(m, "config")]
    assert configs and all(c.use_cache is False for c in configs)  # LlamaConfig's default is True
    assert all(not c.output_attentions and not c.output_hidden_states for c in configs)
    graph = trace(model, spec.example_inputs, batch_size=2)  # no DynamicCache in the output
    out = graph.module(*[v for v in spec.example_inputs(2).values()])
    assert isinstance(out, torch.Tensor) and out.shape == (2, 16, 128)


def test_a_plain_model_file_keeps_its_config(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "import torch, types\n"
        "class Cached(torch.nn.Linear):\n"
        "    def __init__(self):\n"
        "        super().__init__(2, 2)\n"
        "        self.config = types.SimpleNamespace(use_cache=True)\n"
        "def model():\n    return Cached()\n"
        "def example_inputs(b):\n    return (torch.randn(b, 2),)\n",
    )
    assert load_model(path).build().config.use_cache is True  # not a transformers model: left as written
