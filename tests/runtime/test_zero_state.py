"""Each ZeRO stage's model state per rank, as the runtime holds it, against the plan's to the byte (dp = 2, CPU)."""

from __future__ import annotations

from typing import Any

import pytest

from pyplan import load_model
from pyplan.plan import Workload
from pyplan.solve.state import stage_state_bytes, zero1_shares
from tests.runtime.conftest import Launches

# The parts of the launches that tests/runtime/conftest.py makes, which the tests here read: (ranks, script).
LAUNCH_PARTS = ((2, "_zero_state"),)


def test_zero1_gives_each_tensor_to_the_emptiest_replica_largest_first() -> None:
    assert zero1_shares([5, 1, 3, 3], 2) == [[0, 1], [2, 3]]
    assert zero1_shares([4, 4, 4], 2) == [[0, 2], [1]]


@pytest.fixture(scope="module")
def launched(launches: Launches) -> dict[str, Any]:
    """What _zero_state.py found, for the tests below."""
    return launches.part(2, "_zero_state").results()


@pytest.mark.distributed
def test_each_rank_holds_the_model_state_the_plan_counts(launched: dict[str, Any]) -> None:
    held = launched["held"]
    shapes = [tuple(p.shape) for p in load_model("zoo:gpt-tiny").build().parameters()]
    for key, ranks in held.items():
        zero, precision = key.split("/")
        plan = stage_state_bytes(shapes, Workload(global_batch=8, precision=precision), 2, int(zero))
        # The plan counts the fullest replica (ZeRO-1's greedy split gives the ranks different shares).
        assert max(ranks) == plan, (key, ranks, plan)


@pytest.mark.distributed
def test_zero3_under_mixed_precision_computes_in_bf16_and_reduces_in_fp32(launched: dict[str, Any]) -> None:
    """FSDP2's policy, not autocast: the gradients are a bf16 model's, cast to fp32 and averaged over the replicas
    (autocast's differ from them by 2e-2 on this model)."""
    assert launched["mixed"] < 1e-5, launched["mixed"]


@pytest.mark.distributed
def test_training_resumes_from_a_checkpoint_under_another_layout(launched: dict[str, Any]) -> None:
    """Saved after 2 steps under one layout, the third step under another: the parameters and every step's clipped
    gradient norm are one process's (float64), resharding to and from ZeRO-3, ZeRO-1's optimizer shards and a
    pipeline's tied embedding included."""
    resumed = launched["resumed"]
    assert len(resumed) == 4
    for case, (err, norm) in resumed.items():
        assert err < 1e-9 and norm < 1e-9, (case, err, norm)


@pytest.mark.distributed
def test_bf16_master_accumulates_and_averages_fp32_gradients_of_bf16_weights(launched: dict[str, Any]) -> None:
    """bf16-master at dp 2 (ZeRO 0 and 1) and over 2 pipeline stages: each gradient is a bf16 model's, summed over
    the micro-batches and averaged over the replicas in fp32. The tied embedding's two uses are summed in fp32 across
    the pipeline's stages, in bf16 by one process's autograd: within bf16's rounding (2^-8) of it."""
    master = launched["master"]
    for case in ("dp 2 ZeRO-0", "dp 2 ZeRO-1", "pp 2"):
        assert master[case] < 1e-5, (case, master[case])
    assert master["pp 2 tied"] < 2**-7, master["pp 2 tied"]
    assert master["dp 2 ZeRO-0 dtype"] == master["dp 2 ZeRO-1 dtype"] == "{torch.float32}"
    # The replicas' sums overlap the backward: with 64 KiB buckets, several, most launched before it ended, in the
    # same order on both ranks (else the sums would mix buckets).
    buckets, early, err = master["buckets"]
    assert buckets >= 4 and early >= buckets // 2 and err < 1e-5, master["buckets"]


@pytest.mark.distributed
def test_bf16_master_with_bf16_grads_accumulates_and_reduces_in_bf16(launched: dict[str, Any]) -> None:
    """NeMo's performance recipes' bf16 (grad_reduce_in_fp32=False): the gradients are bf16, summed and averaged in
    bf16, so within bf16's rounding (2^-8) of the fp32 sums, not at fp32's."""
    master = launched["master"]
    for zero in (0, 1):
        case = f"dp 2 ZeRO-{zero} bf16 grads"
        assert master[case + " dtype"] == "{torch.bfloat16}"
        assert 1e-6 < master[case] < 2**-6, (case, master[case])


@pytest.mark.distributed
def test_bf16_master_resumes_its_fp32_master_weights(launched: dict[str, Any]) -> None:
    """A checkpoint holds the master weights and their optimizer state, resharded between ZeRO-1 and ZeRO-0: the
    third step after resuming is the uninterrupted run's (bf16 weights rounded up to fp32 would miss by ~2^-9)."""
    resumed = launched["master_resumed"]
    assert set(resumed) == {"dp 2 ZeRO-1 -> dp 2", "dp 2 -> dp 2 ZeRO-1"}
    assert all(err < 1e-6 for err in resumed.values()), resumed
