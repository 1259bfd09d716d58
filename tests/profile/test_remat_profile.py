"""The live-memory tracker, and the remat model's figures per block: hand counts, fake against real, big models."""

from __future__ import annotations

import dataclasses
import gc
import resource
import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import pyplan
from pyplan import linearize, trace, zoo
from pyplan._torch import run_without_compute
from pyplan.graph.layergraph import Affine
from pyplan.profile import LiveMemory, remat_bytes, remat_chain
from pyplan.profile.remat import block_memory

SMALL = ["mlp-tiny", "resnet-tiny", "vgg-tiny", "gpt-tiny"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Two cores shared with other jobs: torch's default of one thread per core makes tiny kernels spin and wait.
    # Module-scoped, so that module-scoped fixtures compute with the same thread count (and reduction order).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- LiveMemory ---


def test_counts_each_storage_once_and_until_it_dies() -> None:
    x = torch.randn(1000)
    with LiveMemory() as mem:
        y = x * 2  # 4000 bytes
        views = [y.view(10, 100), y[::2], y.t()]
        z = torch.relu(y)  # 4000 more
        both = mem.mark()
        del y, z
        views_only = mem.mark()  # y's storage lives on in its views
        del views
    assert mem.allocations == 2
    assert (mem.bytes_at(both), mem.bytes_at(views_only), mem.current_bytes, mem.peak_bytes) == (8000, 4000, 0, 8000)
    assert [e.delta_bytes for e in mem.events] == [4000, 4000, -4000, -4000]
    assert mem.events[0].op == "aten.mul.Tensor" and mem.events[-1].op == ""


def test_storages_from_before_are_never_counted() -> None:
    x = torch.randn(256)
    with LiveMemory() as mem:
        x.add_(1)  # in place: x's own storage
        x.view(16, 16).mul_(2)
        detached = x.detach()
    assert mem.allocations == 0 and mem.peak_bytes == 0
    del detached


def test_peaks_over_stretches_of_the_log() -> None:
    with LiveMemory() as mem:
        a = torch.zeros(100)  # 400
        b = torch.zeros(300)  # 1200
        start = mem.mark()
        del a
        c = torch.zeros(50)  # 200
    assert mem.peak_bytes == 1600
    assert mem.bytes_at(start) == 1600 and mem.peak_bytes_since(start) == 1600
    assert mem.current_bytes == 1400
    assert mem.peak_bytes_since(start + 1) == 1400  # after a died
    assert sorted(mem.live_at(mem.mark()).values()) == [200, 1200]
    del b, c


def test_ignores_parameter_gradients_after_the_fact() -> None:
    layer = nn.Linear(64, 32)
    x = torch.randn(8, 64)
    with LiveMemory() as mem:
        out = torch.relu(layer(x)).sum()
        out.backward()
        del out
    grads = [layer.weight.grad, layer.bias.grad]
    with_grads = mem.peak_bytes
    mem.ignore(g for g in grads if g is not None)
    assert mem.current_bytes == 0
    # Without them: ReLU's output (saved; the Linear's own output died once ReLU ran), the loss, its gradient and
    # the gradient of the Linear's output. With them: once ReLU's backward released its output, the bias and
    # weight gradients on top of the rest.
    assert mem.peak_bytes == 8 * 32 * 4 + 4 + 4 + 8 * 32 * 4
    assert with_grads == 4 + 4 + 8 * 32 * 4 + 32 * 4 + 64 * 32 * 4


def test_counts_fake_tensors_without_allocating_them() -> None:
    layer = nn.Linear(4096, 4096)

    def run(convert: object) -> tuple[int, int]:
        x = convert(torch.randn(2, 4096))  # type: ignore[operator]
        with LiveMemory() as mem:
            h = layer(x)
            y = torch.relu(h)
            del h
            after = mem.current_bytes
            del y
        return mem.peak_bytes, after

    peak, after = run_without_compute(layer, run)
    assert (peak, after) == (2 * 2 * 4096 * 4, 2 * 4096 * 4)
    x = torch.zeros(1 << 20, device="meta")
    with LiveMemory() as mem:
        y = x + 1
    assert mem.peak_bytes == 4 << 20
    del y


def test_counts_only_the_given_device() -> None:
    with LiveMemory(device="cuda") as mem:
        y = torch.zeros(1000)
    assert mem.allocations == 0
    del y


# --- the remat model's figures ---


def test_figures_of_an_mlp_by_hand() -> None:
    # Linear(32, 64), ReLU, Linear(64, 64), ReLU, Linear(64, 10), one block each, batch 8, float32.
    spec = zoo.get("mlp-tiny")
    chain = linearize(trace(spec.build(), spec.example_inputs))
    mems, grads = block_memory(chain, spec.example_inputs, 8)
    h, out = 8 * 64 * 4, 8 * 10 * 4
    # A Linear keeps its output (its input and weight are the block's inputs and parameters); a ReLU keeps its
    # output (saved by itself). The model's own input gets no gradient; every cut after it does.
    assert [m.kept_bytes for m in mems] == [h, h, h, h, out]
    assert [m.out_bytes for m in mems] == [h, h, h, h, out]
    assert grads == [0, h, h, h, h, out]
    # Backward of the first Linear: its output's gradient and kept output; no input gradient (the model's input).
    assert mems[0].bwd_peak_bytes == 2 * h
    # A middle ReLU: kept output, output gradient, input gradient.
    assert mems[1].bwd_peak_bytes == 3 * h


def test_who_saves_each_output_by_hand() -> None:
    # Linear(32, 64), ReLU, Linear(64, 64), ReLU, Linear(64, 10): a Linear saves its input, a ReLU its output, so
    # a Linear's output is saved by nobody (it dies with the ReLU's forward) and a ReLU's by itself and the next
    # Linear.
    spec = zoo.get("mlp-tiny")
    chain = linearize(trace(spec.build(), spec.example_inputs))
    mems, _ = block_memory(chain, spec.example_inputs, 8)
    assert [[savers for _, _, savers in m.out_values] for m in mems] == [[()], [(1, 2)], [()], [(3, 4)], [()]]
    assert all(m.saves for m in mems)


def test_adds_save_nothing_and_share_their_gradient() -> None:
    # ResNet's first bottleneck: bn2's output is read by the residual add only, which saves nothing, and the
    # add's backward hands one gradient to both its inputs (bn2's output and the stem's ReLU output, passed on
    # from block 2): cut 9's gradients are one storage.
    spec = zoo.get("resnet-tiny")
    chain = linearize(trace(spec.build(), spec.example_inputs))
    names = [b.name.removeprefix("model.") for b in chain.blocks]
    mems, grads = block_memory(chain, spec.example_inputs, 2)
    bn2, add = names.index("layer1.0.bn2"), names.index("layer1.0")
    assert add == bn2 + 1 and not mems[add].saves
    assert [savers for _, _, savers in mems[bn2].out_values] == [()]
    ((size, last, _),) = mems[bn2].out_values
    assert last == add and grads[add] == size  # two values live at the add's input cut, one gradient storage


@pytest.mark.parametrize("name", SMALL)
def test_fake_and_real_tensors_agree(name: str) -> None:
    spec = zoo.get(name)
    model = spec.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    chain = linearize(trace(model, spec.example_inputs))
    assert block_memory(chain, spec.example_inputs, 3) == block_memory(chain, spec.example_inputs, 3, fake=False)
    # The real run leaves the model as it was: no gradients, BatchNorm statistics unchanged.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["resnet-tiny", "gpt-tiny"])
def test_bytes_are_affine_in_the_batch(name: str) -> None:
    spec = zoo.get(name)
    chain = linearize(trace(spec.build(), spec.example_inputs))
    profile = remat_bytes(chain, spec.example_inputs, (2, 4))
    direct = remat_chain(chain, spec.example_inputs, 7)
    assert profile.chain(7, direct.fwd_s, direct.bwd_s) == direct
    assert all(isinstance(b.kept_bytes, Affine) for b in profile.blocks)


def test_times_come_from_the_profiled_blocks() -> None:
    spec = zoo.get("mlp-tiny")
    chain = linearize(trace(spec.build(), spec.example_inputs))
    assert remat_chain(chain, spec.example_inputs, 4).fwd_s == (0.0,) * len(chain)
    timed = [dataclasses.replace(b, fwd_time_s=Affine(1e-3, 1e-4), bwd_time_s=Affine(2e-3, 0.0)) for b in chain.blocks]
    rc = remat_chain(dataclasses.replace(chain, blocks=timed), spec.example_inputs, 4, time_scale=0.5)
    assert rc.fwd_s == pytest.approx([0.5 * (4e-3 + 1e-4)] * len(chain))
    assert rc.bwd_s == pytest.approx([0.5 * 8e-3] * len(chain))


def test_a_billion_parameter_model_is_measured_without_memory() -> None:
    spec = zoo.get("llama-1b-style")
    with torch.device("meta"):
        model = spec.build()
    assert sum(p.numel() for p in model.parameters()) > 1e9
    chain = linearize(trace(model, spec.example_inputs, batch_size=1))
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rc = remat_chain(chain, spec.example_inputs, 1)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64, f"measuring grew the process by {grown_mib:.0f} MiB"
    # Every transformer layer keeps gigabytes at 2048 tokens; none of it was allocated.
    assert max(rc.kept_bytes) > 1e9


def test_a_checkpoint_call_has_a_measured_cost() -> None:
    from pyplan.profile.measure import checkpoint_call_s

    cost = checkpoint_call_s()
    assert 0 < cost < 0.01  # tens of microseconds on a CPU; never free, never milliseconds


# --- selective checkpointing's forward, measured without torch's checkpoint ---


def _under_torch_checkpoint(mod, args, first, casts):  # type: ignore[no-untyped-def]
    """The reference: `_selective_forward`'s figures with the block run under torch's own selective checkpoint."""
    from torch.utils.checkpoint import checkpoint

    from pyplan._torch import OpRecorder, selective_contexts, storage_key, tensor_leaves
    from pyplan.profile.pieces import leaf_inputs

    leaves = leaf_inputs(args, first=first)
    before = {storage_key(t) for t in tensor_leaves(list(leaves))}
    recorder = OpRecorder()
    with LiveMemory() as mem, recorder:
        with casts():
            out = checkpoint(mod, *leaves, use_reentrant=False, context_fn=selective_contexts)
        kept = mem.current_bytes
        keys = list(dict.fromkeys(k for t in tensor_leaves(out) if (k := storage_key(t)) not in before))
        graph = [t.grad_fn for t in tensor_leaves(out)]  # the checkpoint lives on with the graph, the outputs not
        del out
        holds = tuple(mem.holds(k) for k in keys)
        del graph
    return kept, holds, list(recorder.ops)


def _sequence_parallel_gpt_rank() -> tuple[pyplan.Chain, object]:
    """Rank 0 of a GPT at tensor-parallel degree 2 with sequence parallelism (its gathered inputs saved as slices)."""
    from pyplan.graph.sequence_parallel import sequence_zone
    from pyplan.graph.tensor_parallel import derive_tp_plan
    from pyplan.graph.trace import Examples
    from pyplan.profile.tensor_parallel import local_chain
    from pyplan.zoo.transformer import GPT, GPTConfig

    config = GPTConfig(vocab_size=96, n_ctx=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    inputs = lambda b: (torch.randint(0, 96, (b, 32)),)  # noqa: E731
    with torch.device("meta"):
        model = GPT(config)
    chain = linearize(trace(model, inputs))
    plan = derive_tp_plan(chain.graph)
    zone = sequence_zone(chain.graph, plan, 2)
    assert zone, zone.reason
    return local_chain(chain, plan, 2, Examples(inputs), zone), inputs


@pytest.mark.parametrize("case", ["gpt-tiny", "gpt-tiny real", "resnet-tiny", "llama bf16", "gpt tp2 sp bf16"])
def test_the_selective_forward_keeps_what_torchs_checkpoint_keeps(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every block's figures, selective ones included (kept bytes, which outputs the cache holds, the share of the
    # forward recomputed), as when the selective forward ran under torch.utils.checkpoint itself.
    remat = sys.modules[block_memory.__module__]
    autocast = torch.bfloat16 if "bf16" in case else None
    if case == "gpt tp2 sp bf16":
        chain, inputs = _sequence_parallel_gpt_rank()
    elif case == "llama bf16":
        from pyplan.zoo.transformer import Llama, LlamaConfig

        config = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)
        inputs = lambda b: (torch.randint(0, 128, (b, 64)),)  # noqa: E731
        with torch.device("meta"):
            chain = linearize(trace(Llama(config), inputs))
    else:
        spec = zoo.get(case.removesuffix(" real"))
        chain, inputs = linearize(trace(spec.build(), spec.example_inputs)), spec.example_inputs
    fake = not case.endswith("real")
    ours = block_memory(chain, inputs, 3, fake=fake, autocast=autocast)
    assert any(m.selective_kept_bytes for m in ours[0])
    monkeypatch.setattr(remat, "_selective_forward", _under_torch_checkpoint)
    assert ours == block_memory(chain, inputs, 3, fake=fake, autocast=autocast)
