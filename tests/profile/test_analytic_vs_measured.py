"""The analytic model against measurement on this machine: block times from the calibrated roofline of the
`local` device against block times measured on it.

The band. For each model, over the blocks whose measured forward or backward time is at least 0.2 ms (about ten
times the ~20 µs it costs to run one block alone, a cost the analytic model does not carry: in a stage the
blocks run as one module), the median of analytic / measured must lie in [0.45, 1.2]. On the 2-core CPU this
was written on, with one thread, the per-model medians over seven runs (one with both cores busy with other
processes) were mlp 0.78-0.88, resnet-tiny 0.83-0.95, gpt-tiny 0.70-0.88; a later CI run (2026-11-23) measured
gpt-tiny at 0.54, on a day this VM's block times moved by up to 70 % between processes. They sit below 1 because
calibration keeps the best of several rounds while measurement keeps medians, and because a block run alone pays
for fresh output pages and a Python call per view that the analytic model does not count. The band leaves 0.09 of
margin below the lowest median seen and 0.25 above the highest. What it catches: calibrating elementwise ops on
operands that stay in cache put relu at three times the memory roof (medians near 2 for ResNets); timing them
on buffers larger than glibc's mmap threshold timed page faults instead (medians near 0.3); one efficiency per
op class at one size, without the fixed cost of small kernels, put the GPT medians near 0.4.

On a CPU, times are the calling thread's CPU time (one thread), in calibration and here, so other processes'
load on a shared machine does not move the ratio: wall-clock medians dropped it to 0.15 with two busy
neighbours. On CUDA the band is unverified.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyplan import linearize, trace
from pyplan.hardware.catalog import get_gpu
from pyplan.load import load_model
from pyplan.profile.analytic import Roofline, block_times_analytic
from pyplan.profile.calibrate import CalibrationOptions, calibrate, write_calibration
from pyplan.profile.measure import TimingOptions, block_times
from tests.conftest import EXAMPLES

BAND = (0.45, 1.2)
NONTRIVIAL_S = 2e-4
MODELS = [(f"{EXAMPLES}/mlp.py", 128), ("zoo:resnet-tiny", 32), ("zoo:gpt-tiny", 16)]


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Roofline]:
    """The `local` device's roofline after a quick calibration into a temporary cache directory."""
    cache: Path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYPLAN_CACHE_DIR", str(cache))
        write_calibration(calibrate(CalibrationOptions(threads=1, quick=True, link=False)))
        yield Roofline.from_gpu(get_gpu("local"))


def ratios(ref: str, batch: int, device: Roofline) -> list[float]:
    """analytic / measured for the forward and backward of every block that takes at least NONTRIVIAL_S."""
    spec = load_model(ref)
    chain = linearize(trace(spec.build(), spec.example_inputs, batch_size=batch))
    sizes = (batch // 2, batch)
    measured = block_times(chain, spec.example_inputs, sizes, options=TimingOptions(threads=1))
    analytic = block_times_analytic(chain, spec.example_inputs, device, sizes)
    pairs = [(a(batch), m(batch)) for ma, aa in zip(measured, analytic) for m, a in zip(ma, aa)]
    return [a / m for a, m in pairs if m >= NONTRIVIAL_S]


@pytest.mark.parametrize(("ref", "batch"), MODELS, ids=["mlp", "resnet-tiny", "gpt-tiny"])
def test_analytic_block_times_match_measured_ones(ref: str, batch: int, local: Roofline) -> None:
    found = ratios(ref, batch, local)
    assert len(found) >= 5, f"only {len(found)} blocks take {NONTRIVIAL_S * 1e3} ms or more"
    median = statistics.median(found)
    assert BAND[0] <= median <= BAND[1], f"median analytic/measured {median:.2f} outside {BAND}: {found}"
