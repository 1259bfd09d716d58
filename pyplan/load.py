"""Load a model reference: `model.py`, `model.py:function`, `zoo:NAME`, `hf:MODEL_TYPE[:k=v,...]` or `timm:NAME`."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from pyplan import hub, zoo
from pyplan.errors import ModelLoadError
from pyplan.spec import ModelSpec

__all__ = ["EXPECTED_SHAPE", "load_model"]

EXPECTED_SHAPE = (
    "a model file defines `def model() -> nn.Module` and `def example_inputs(batch_size: int) -> tuple[Tensor, ...]`"
    " (optionally `loss(output, target)` and `target(batch_size)`)"
)


def _import_file(path: str) -> ModuleType:
    if not os.path.exists(path):
        raise ModelLoadError(f"model file '{path}' does not exist; give a path to a .py file or zoo:NAME")
    if os.path.isdir(path) or not path.endswith(".py"):
        raise ModelLoadError(f"'{path}' is not a .py file; give a path to a model file or zoo:NAME")
    name = "pyplan_user_model_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"cannot import '{path}' as a Python module")
    module = importlib.util.module_from_spec(spec)
    # The file's own directory first, so it can import its neighbours.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        # A model file that exits when imported (a script's `sys.exit()` at module level) would end pyplan silently.
        raise ModelLoadError(
            f"importing '{path}' called sys.exit({exc.code!r}); put the file's script part under "
            '`if __name__ == "__main__":`'
        ) from None
    except Exception as exc:
        raise ModelLoadError(f"importing '{path}' failed with {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.pop(0)
    return module


def _optional(module: ModuleType, name: str, path: str) -> Callable[..., Any] | None:
    fn = getattr(module, name, None)
    if fn is not None and not callable(fn):
        raise ModelLoadError(f"'{name}' in '{path}' is not a function; {EXPECTED_SHAPE}")
    return fn


def _required(module: ModuleType, name: str, path: str) -> Callable[..., Any]:
    fn = _optional(module, name, path)
    if fn is None:
        raise ModelLoadError(f"'{path}' defines no {name}(); {EXPECTED_SHAPE}")
    return fn


# Config flags of a transformers model that make it return more than training reads: its key/value cache (a
# DynamicCache, which torch.export cannot return), every layer's attention weights and hidden states. An `hf:`
# reference builds with them off (pyplan.hub); a model file builds as its author wrote it, so they are turned off here.
_INFERENCE_OUTPUTS = ("use_cache", "output_attentions", "output_hidden_states")


def _for_training(module: nn.Module) -> None:
    """Turn off the inference outputs of a transformers model (`_INFERENCE_OUTPUTS`) in the config of each of its
    modules; transformers is imported only by the model itself, so a module is one of its models only if it is."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        return
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if not isinstance(config, transformers.PretrainedConfig):
            continue
        for flag in _INFERENCE_OUTPUTS:
            if getattr(config, flag, False) is True:
                setattr(config, flag, False)


def _checked_builder(fn: Callable[[], Any], where: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        try:
            module = fn()
        except Exception as exc:
            raise ModelLoadError(f"{where}() raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(module, nn.Module):
            raise ModelLoadError(f"{where}() returned {type(module).__name__}, not an nn.Module; {EXPECTED_SHAPE}")
        _for_training(module)
        return module

    return build


def load_model(ref: str) -> ModelSpec:
    """The ModelSpec named by `ref`: `path/to/model.py`, `path/to/model.py:builder`, `zoo:NAME`,
    `hf:MODEL_TYPE[:key=value,...]` (a transformers config, see pyplan.hub.hf_model) or `timm:NAME`."""
    if ref.startswith("zoo:"):
        return zoo.get(ref.removeprefix("zoo:"))
    if ref.startswith(("hf:", "timm:")):
        return hub.hf_model(ref) if ref.startswith("hf:") else hub.timm_model(ref)
    path, _, func = ref.partition(":") if ref.count(":") == 1 and not os.path.exists(ref) else (ref, "", "")
    module = _import_file(path)
    builder_name = func or "model"
    builder = _required(module, builder_name, path)
    example_inputs = _required(module, "example_inputs", path)
    return ModelSpec(
        name=f"{os.path.basename(path)}:{builder_name}" if func else os.path.basename(path),
        build=_checked_builder(builder, f"{os.path.basename(path)}:{builder_name}"),
        example_inputs=example_inputs,
        loss=_optional(module, "loss", path),
        target=_optional(module, "target", path),
    )
