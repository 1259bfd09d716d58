"""The errors pyplan raises at its boundaries, in the user's terms and with the values."""

from __future__ import annotations

__all__ = ["InfeasibleError", "ModelLoadError", "PlanError", "TraceError"]


class PlanError(ValueError):
    """Bad input to pyplan: the message names the problem and the fix in one line."""


class ModelLoadError(PlanError):
    """A model file, `path.py:function` or `zoo:NAME` that cannot be loaded."""


class TraceError(PlanError):
    """A model that torch.fx cannot trace, or whose traced graph pyplan cannot use."""


class InfeasibleError(PlanError):
    """No plan fits: the message says which stage needs how many bytes and what the GPU has."""
