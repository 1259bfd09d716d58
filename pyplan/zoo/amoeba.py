"""An AmoebaNet-D-like cell network (Real et al. 2019), in the (L, D) configurations GPipe trained (Huang et al. 2019).

Layout (NASNet's ImageNet layout, which AmoebaNet keeps): a 3x3 stride-2 stem convolution, two reduction cells
("stem cells", at D/4 and D/2 channels), then three stacks of L/3 normal cells at D, 2D and 4D channels with a
reduction cell (2D, 4D) between stacks, then ReLU, global average pooling and a linear classifier. Every cell
reads the outputs of the two cells before it, so two tensors cross each boundary between cells.

A cell first maps its two inputs to C channels ("preprocessing": ReLU-conv1x1-BN, or a factorized reduction when
the older input is twice as large), then builds five nodes, each the sum of two operations applied to earlier
states (0: older input, 1: newer input, 2..6: the nodes), and concatenates some of them. The operations are
those of the AmoebaNet search space: separable convolutions 3x3/5x5/7x7 (ReLU, depthwise, pointwise, BN, twice),
3x3 average and max pooling, a 1x7 then 7x1 convolution, and the identity. The cells below are this module's
own genotype over that search space ("like"): the published AmoebaNet-D genotype also uses 1x1 and 3x3
convolutions and 2x2 pooling. In a reduction cell, the operations that read a cell input have stride 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["AMOEBANET_CONFIGS", "NORMAL_CELL", "REDUCTION_CELL", "AmoebaNet", "AmoebaNetConfig", "CellGenotype"]


@dataclass(frozen=True)
class CellGenotype:
    """Five nodes, each `(op_a, input_a, op_b, input_b)` over states 0, 1 (cell inputs) and 2.. (nodes),
    and the states concatenated into the cell's output."""

    nodes: tuple[tuple[str, int, str, int], ...]
    concat: tuple[int, ...]


NORMAL_CELL = CellGenotype(
    nodes=(
        ("sep_conv_3x3", 1, "identity", 0),
        ("sep_conv_5x5", 0, "avg_pool_3x3", 1),
        ("conv_1x7_7x1", 1, "max_pool_3x3", 2),
        ("sep_conv_3x3", 3, "identity", 1),
        ("avg_pool_3x3", 0, "sep_conv_7x7", 4),
    ),
    concat=(3, 4, 5, 6),
)
# Every operation on a cell input (0 or 1) is one that can stride; the identities read nodes only.
REDUCTION_CELL = CellGenotype(
    nodes=(
        ("max_pool_3x3", 0, "sep_conv_7x7", 1),
        ("sep_conv_5x5", 0, "avg_pool_3x3", 1),
        ("conv_1x7_7x1", 0, "max_pool_3x3", 1),
        ("sep_conv_3x3", 2, "identity", 3),
        ("avg_pool_3x3", 2, "identity", 4),
    ),
    concat=(4, 5, 6),
)


def _relu_conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out))


class FactorizedReduce(nn.Module):
    """Halves the spatial size: two 1x1 stride-2 convolutions, one shifted by a pixel, concatenated, then BN.

    The shifted path pads one row and column at the end before dropping the first, so odd sizes round up the
    same way as the cells' stride-2 operations (7x7 becomes 4x4 on both paths).
    """

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        if c_out % 2:
            raise ValueError(f"a factorized reduction needs an even channel count, got {c_out}")
        self.relu = nn.ReLU()
        self.conv_1 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.conv_2 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        shifted = F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        return self.bn(torch.cat([self.conv_1(x), self.conv_2(shifted)], dim=1))


class SepConv(nn.Module):
    """ReLU, depthwise kxk, pointwise 1x1, BN, twice (the first depthwise carries the stride)."""

    def __init__(self, c: int, k: int, stride: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for s in (stride, 1):
            layers += [
                nn.ReLU(),
                nn.Conv2d(c, c, k, stride=s, padding=k // 2, groups=c, bias=False),
                nn.Conv2d(c, c, 1, bias=False),
                nn.BatchNorm2d(c),
            ]
        self.op = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class Conv1x7x7x1(nn.Module):
    """ReLU, a 1x7 then a 7x1 convolution (each strides along its own axis), BN."""

    def __init__(self, c: int, stride: int) -> None:
        super().__init__()
        self.op = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(c, c, (1, 7), stride=(1, stride), padding=(0, 3), bias=False),
            nn.Conv2d(c, c, (7, 1), stride=(stride, 1), padding=(3, 0), bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


def _operation(name: str, c: int, stride: int) -> nn.Module:
    if name.startswith("sep_conv_"):
        return SepConv(c, int(name[-1]), stride)
    if name == "conv_1x7_7x1":
        return Conv1x7x7x1(c, stride)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride=stride, padding=1)
    if name == "identity" and stride == 1:
        return nn.Identity()
    raise ValueError(f"no operation '{name}' at stride {stride}")


class Cell(nn.Module):
    """One normal or reduction cell on C channels; its output has `len(genotype.concat) * C` channels."""

    def __init__(
        self, genotype: CellGenotype, c_prev_prev: int, c_prev: int, c: int, *, reduction: bool, reduction_prev: bool
    ) -> None:
        super().__init__()
        self.preprocess0 = FactorizedReduce(c_prev_prev, c) if reduction_prev else _relu_conv_bn(c_prev_prev, c)
        self.preprocess1 = _relu_conv_bn(c_prev, c)
        self.inputs = [(a, b) for _, a, _, b in genotype.nodes]
        self.ops = nn.ModuleList()
        for op_a, a, op_b, b in genotype.nodes:
            for op, index in ((op_a, a), (op_b, b)):
                self.ops.append(_operation(op, c, 2 if reduction and index < 2 else 1))
        self.concat = genotype.concat
        self.out_channels = len(genotype.concat) * c

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = [self.preprocess0(s0), self.preprocess1(s1)]
        for i, (a, b) in enumerate(self.inputs):
            states.append(self.ops[2 * i](states[a]) + self.ops[2 * i + 1](states[b]))
        return torch.cat([states[i] for i in self.concat], dim=1)


@dataclass(frozen=True)
class AmoebaNetConfig:
    """GPipe's (L, D), as read here: `num_layers` normal cells in all (three stacks of L/3), `filters` channels
    per operation in the first stack (doubled at each reduction)."""

    num_layers: int = 18
    filters: int = 208
    num_classes: int = 1000
    in_channels: int = 3


class AmoebaNet(nn.Module):
    """Stem, two stem reduction cells, three stacks of normal cells with reductions between, classifier."""

    def __init__(
        self,
        cfg: AmoebaNetConfig,
        normal: CellGenotype = NORMAL_CELL,
        reduction: CellGenotype = REDUCTION_CELL,
    ) -> None:
        super().__init__()
        if cfg.num_layers % 3 or cfg.num_layers < 3:
            raise ValueError(f"num_layers must be a positive multiple of 3 (three stacks), got {cfg.num_layers}")
        if cfg.filters % 4:
            raise ValueError(f"filters must be a multiple of 4 (stem cells at filters/4), got {cfg.filters}")
        d, per_stack = cfg.filters, cfg.num_layers // 3
        stem = d // 4
        self.stem = nn.Sequential(
            nn.Conv2d(cfg.in_channels, stem, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(stem)
        )
        # (channels per operation, is a reduction cell) of every cell in order.
        plan: list[tuple[int, bool]] = [(d // 4, True), (d // 2, True)]
        for k in range(3):
            if k > 0:
                plan.append((d << k, True))
            plan += [(d << k, False)] * per_stack
        cells: list[Cell] = []
        c_prev_prev = c_prev = stem
        reduction_prev = False
        for c, is_reduction in plan:
            cell = Cell(
                reduction if is_reduction else normal,
                c_prev_prev,
                c_prev,
                c,
                reduction=is_reduction,
                reduction_prev=reduction_prev,
            )
            cells.append(cell)
            c_prev_prev, c_prev, reduction_prev = c_prev, cell.out_channels, is_reduction
        self.cells = nn.ModuleList(cells)
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c_prev, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.classifier(torch.flatten(self.avgpool(self.relu(s1)), 1))


# GPipe (Huang et al. 2019), Table 1: AmoebaNet-D (18, 208) on one accelerator and (36, 544) on four.
AMOEBANET_CONFIGS: dict[str, AmoebaNetConfig] = {
    "amoebanet-d-18": AmoebaNetConfig(num_layers=18, filters=208),
    "amoebanet-d-36": AmoebaNetConfig(num_layers=36, filters=544),
}
