"""The layer graph: every fx node of a traced model with shapes, dtypes and bytes per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

__all__ = ["Affine", "GraphNode", "LayerGraph", "Piecewise", "TensorInfo"]


@dataclass(frozen=True)
class Affine:
    """A quantity linear in the micro-batch size b: `per_sample·b + fixed`.

    Used for bytes (a tensor of shape (b, ...) plus a batch-independent part such as a mask buffer),
    FLOPs and times (the linear stage model `t(b) = α·b + β` of Huang et al., eq. 2-3).
    """

    per_sample: float = 0.0
    fixed: float = 0.0

    def __call__(self, batch_size: float) -> float:
        return self.per_sample * batch_size + self.fixed

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.per_sample + other.per_sample, self.fixed + other.fixed)

    @staticmethod
    def fit(sizes: list[int], values: list[float]) -> Affine:
        """Least-squares line through (size, value) points with slope and intercept kept non-negative.

        Times cannot shrink with more samples nor be negative at b = 0; measurement noise on tiny blocks can
        suggest either, so the fit falls back to a constant (slope 0) or a line through the origin.
        """
        if len(set(sizes)) < 2:
            raise ValueError(f"fitting a line needs two distinct batch sizes, got {sizes}")
        n = len(sizes)
        mean_b = sum(sizes) / n
        mean_v = sum(values) / n
        var = sum((b - mean_b) ** 2 for b in sizes)
        slope = sum((b - mean_b) * (v - mean_v) for b, v in zip(sizes, values)) / var
        if slope < 0:
            return Affine(0.0, max(mean_v, 0.0))
        if mean_v - slope * mean_b < 0:
            through_origin = sum(b * v for b, v in zip(sizes, values)) / sum(b * b for b in sizes)
            return Affine(max(through_origin, 0.0), 0.0)
        return Affine(slope, mean_v - slope * mean_b)

    @staticmethod
    def from_two(b1: int, v1: float, b2: int, v2: float) -> Affine:
        """The exact line through two points (bytes are exactly affine in b, so no fitting is needed)."""
        slope = (v2 - v1) / (b2 - b1)
        return Affine(slope, v1 - slope * b1)


@dataclass(frozen=True)
class Piecewise(Affine):
    """A time measured at several micro-batch sizes: the straight line between neighbouring sizes, and beyond the
    smallest and largest along the first and last segments (at least 0).

    Times are not linear in b over a wide range: a block's per-sample cost falls while a batch is too small to
    fill the machine and rises once its tensors spill out of a cache. Measured on this project's 2-core VM, vgg-
    tiny's blocks timed at 1, 2 and 4 samples and extrapolated to 16 gave 5.58 ms of forward and 5.51 ms of
    backward; timed at 8 and 16, 4.48 and 3.63 ms. So a measured profile times the sizes the plans use and
    interpolates between them. `per_sample` and `fixed` hold the least-squares line through the points (reports,
    JSON, and code that wants one line); calling it interpolates. Values are made non-decreasing in b (a time
    cannot shrink with more samples; the noise of a measurement can say so).
    """

    points: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def through(sizes: list[int], values: list[float]) -> Piecewise:
        """The curve through (size, value) points: two or more distinct sizes; equal sizes keep their mean."""
        by_size: dict[int, list[float]] = {}
        for b, v in zip(sizes, values):
            by_size.setdefault(int(b), []).append(max(float(v), 0.0))
        if len(by_size) < 2:
            raise ValueError(f"a curve needs two or more distinct batch sizes, got {sizes}")
        points, high = [], 0.0
        for b in sorted(by_size):
            high = max(high, sum(by_size[b]) / len(by_size[b]))
            points.append((b, high))
        line = Affine.fit([b for b, _ in points], [v for _, v in points])
        return Piecewise(line.per_sample, line.fixed, tuple(points))

    def __call__(self, batch_size: float) -> float:
        pts = self.points
        if len(pts) < 2:
            return Affine.__call__(self, batch_size)
        k = 1
        while k < len(pts) - 1 and batch_size > pts[k][0]:
            k += 1
        (b0, v0), (b1, v1) = pts[k - 1], pts[k]
        return max(v0 + (v1 - v0) * (batch_size - b0) / (b1 - b0), 0.0)

    def __add__(self, other: Affine) -> Piecewise:
        sizes = sorted({b for b, _ in self.points} | {b for b, _ in getattr(other, "points", ())})
        return Piecewise.through(sizes, [self(b) + other(b) for b in sizes])

    __radd__ = __add__

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(b for b, _ in self.points)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor produced by a node: shape and dtype at the traced batch size, and its bytes. `batch_dim` is the
    dimension whose size grows with the batch (the batch itself, or tokens flattened from batch and sequence:
    `shape[batch_dim]` is a multiple of the batch size), None where none does."""

    shape: tuple[int, ...]
    dtype: str
    bytes: Affine
    batch_dim: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes_per_sample": self.bytes.per_sample,
            "fixed_bytes": self.bytes.fixed,
            "batch_dim": self.batch_dim,
        }


@dataclass(frozen=True)
class GraphNode:
    """One fx node.

    `op` is the fx opcode (placeholder, get_attr, call_module, call_function, call_method, output);
    `module_path` the qualified name of the innermost module whose forward created the node ('' at top level);
    `inputs` the names of the nodes it reads; `outputs` one TensorInfo per tensor it returns (empty when
    it returns no tensor, e.g. `x.size(0)`); `is_tensor` says whether the value is exactly one tensor, the only
    kind of value a pipeline stage can send; `static` marks values that do not depend on any model input
    (parameters, buffers and what is computed from them alone): a stage recomputes those instead of receiving them.
    """

    name: str
    op: str
    target: str
    module_path: str
    inputs: tuple[str, ...]
    outputs: tuple[TensorInfo, ...]
    is_tensor: bool
    static: bool

    @property
    def bytes(self) -> Affine:
        """Bytes of every tensor this node outputs: the bytes of each of its out-edges."""
        total = Affine()
        for t in self.outputs:
            total = total + t.bytes
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "target": self.target,
            "module_path": self.module_path,
            "inputs": list(self.inputs),
            "outputs": [t.to_json() for t in self.outputs],
            "is_tensor": self.is_tensor,
            "static": self.static,
        }


@dataclass
class LayerGraph:
    """A traced model: the fx nodes in topological order, and the GraphModule they came from.

    `batch_size` is the batch the shapes in `outputs` were recorded at; bytes are per sample plus fixed.
    The GraphModule is kept for splitting and profiling; it is not part of the JSON form.
    """

    nodes: list[GraphNode]
    batch_size: int
    module: fx.GraphModule = field(repr=False, compare=False)
    leaf_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}

    def node(self, name: str) -> GraphNode:
        return self._by_name[name]

    @property
    def placeholders(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.op == "placeholder"]

    @property
    def returns_loss(self) -> bool:
        """Whether the model computes its own loss: one of its outputs is a floating-point scalar (labels or targets
        among its inputs; transformers' models return `loss` first, nanoGPT's `(logits, loss)` second)."""
        out = next((n for n in self.nodes if n.op == "output"), None)
        if out is None:
            return False
        return any(t.shape == () and t.dtype.startswith(("float", "bfloat")) for t in out.outputs)

    def edges(self) -> list[tuple[str, str, Affine]]:
        """Every (producer, consumer, bytes) edge; bytes are the producer's output bytes."""
        return [(i, n.name, self._by_name[i].bytes) for n in self.nodes for i in n.inputs]

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "leaf_modules": list(self.leaf_modules),
            "nodes": [n.to_json() for n in self.nodes],
        }
