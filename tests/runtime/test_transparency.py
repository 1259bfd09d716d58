"""The transparency test: planned pipelines under torchrun train exactly what one process trains."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.runtime.conftest import Launches

# The parts of the launches that tests/runtime/conftest.py makes, which the tests here read: (ranks, script).
LAUNCH_PARTS = ((2, "_transparency"), (4, "_transparency"))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_pipelines_train_like_one_process(world: int, launches: Launches) -> None:
    results = launches.part(world, "_transparency").results()
    meshes = {(r["dp"], r["pp"]) for r in results if r.get("tp", 1) == 1}
    assert meshes == ({(1, 2), (2, 1)} if world == 2 else {(2, 2), (1, 4)})
    schedules = {r["schedule"] for r in results}
    assert {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"} <= schedules
    # Three stages (model chunks) a rank: six stages on two ranks.
    assert ((2, 3) in {(r["pp"], r["v"]) for r in results}) == (world == 2)
    dag_models = {"grouped-mlp-tiny"} if world == 2 else set()
    # Models captured with torch.export: tests/models/branchy.py, pipelined under GPipe and 1F1B, and the Hugging
    # Face families (where transformers is installed).
    hf = {"gpt2", "bert", "llama", "mixtral", "t5", "vit"} if importlib.util.find_spec("transformers") else set()
    plain = {"relu_inplace", "lstm", "transformer_encoder"}
    # What real model code does (tests/models/real/): flattened tokens, stride-dependent views, a custom autograd
    # Function, loss-returning forwards, BatchNorm over 1x1 maps, a padding mask into torch's encoder, experts sized
    # by values, a Hugging Face model built with its cache on.
    real = {"padded_encoder.py", "flat_tokens.py", "stride_views.py", "scan_function.py", "own_loss.py",
            "own_loss_none.py", "small_maps.py", "float_mask.py", "routed_by_value.py",
            *({"hf_cache.py"} if hf else set())}  # fmt: skip
    exported = {"branchy.py", *plain, *real, *hf} if world == 2 else set()
    names = {r["model"].split(":")[1] if ":" in r["model"] else os.path.basename(r["model"]) for r in results
             if r.get("tp", 1) == 1}  # fmt: skip
    assert names == {"resnet-tiny", "gpt-tiny", *dag_models, *exported}
    assert {r["optimizer"] for r in results} == {"sgd", "adamw"}
    assert {r["zero"] for r in results} == ({0, 3} if world == 2 else {0, 1, 3})
    assert {r.get("placement", "pp-inner") for r in results} == (
        {"pp-inner"} if world == 2 else {"pp-inner", "dp-inner"}
    )
    # Plans with rematerialization (checkpointed, nested, offloaded and selectively checkpointed blocks) train
    # the same parameters.
    assert {tuple(r["remat"]) for r in results if "remat" in r and r.get("tp", 1) == 1} == (
        {("periodic", "nested"), ("selective", "selective"), ("nested", "full"), ("full",), ("selective units",)}
        if world == 2
        else set()
    )
    # Stages assigned per operation and not contiguous in the traced order train the same parameters.
    assert [r["contiguous"] for r in results if r.get("dag")] == ([False] if world == 2 else [])
    # Tensor parallelism alone (2 ranks), beside pipeline stages and beside replicas (4 ranks; ZeRO 0, 1 and 3), with
    # and without sequence parallelism: tied embeddings and a fused QKV (gpt-tiny), grouped-query attention (llama),
    # BERT.
    split = [r for r in results if r.get("tp", 1) > 1]
    assert {(r["dp"], r["tp"], r["pp"], r.get("sp", False)) for r in split} == {
        (dp, 2, pp, sp) for dp, pp in ([(1, 1)] if world == 2 else [(1, 2), (2, 1)]) for sp in (False, True)
    }
    assert [r["remat"] for r in split if "remat" in r] == [["full"]]
    # ZeRO-1 (Zero1Optimizer) and ZeRO-3 (FSDP2 over the traced model's pieces) beside tp.
    for zero, models in ((1, {"llama", "bert"}), (3, {"llama"})):
        sharded = {r["model"].split(":")[1] if r["model"].startswith("hf:") else r["model"] for r in split
                   if r["zero"] == zero}  # fmt: skip
        assert sharded == (set() if world == 2 else {"gpt-tiny"} | (models & hf))
    assert {r.get("sp", False) for r in split if r["zero"] == 3} == (set() if world == 2 else {False, True})
    families = {r["model"].split(":")[1] if r["model"].startswith("hf:") else r["model"] for r in split}
    assert families == {"gpt-tiny"} | ({"llama", "bert"} & hf if world == 4 else set())
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed[:3]
