"""A pipeline stage is built from example tensors that hold no memory: one micro-batch's shapes, on the meta device.

PipelineStage takes an example of its inputs and outputs (`input_args`, `output_args`) for their shapes, dtypes and
strides. Up to torch 2.11 it keeps those tensors as given for the life of the stage (`inputs_meta`,
`_configure_outputs_meta`; torch's note: "inputs ... should ideally be on meta device"); from the DTensor metadata
rework (torch 2.12) it keeps only their metadata. On a language model's last stage `output_args` is a micro-batch
of logits: on an H200 under torch 2.11, gpt2-small's stage held b x 1024 x 50257 x 4 bytes (206 MB a sample) that
no plan counts, and its measured peak came out 913, 450 and 220 MB over the plan at micro-batch 4, 2 and 1
(benchmarks/GPU.md). Meta tensors cost nothing under any torch; this machine's torch frees the examples whatever
their device, so the test looks at what the stage is given, not at the step's peak.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pyplan import cut_points, trace
from pyplan.plan import Layout
from pyplan.spec import ModelSpec
from pyplan.zoo import _lm_loss, _next_tokens, _tokens
from pyplan.zoo.transformer import GPT, GPTConfig

# GPT-2's vocabulary on one small layer: the logits are the largest tensor by far (T x V x 4 = 12.9 MB a sample).
CONFIG = GPTConfig(vocab_size=50257, n_ctx=64, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
SPEC = ModelSpec(
    name="gpt-50k-vocab",
    build=partial(GPT, CONFIG),
    example_inputs=partial(_tokens, vocab=CONFIG.vocab_size, seq_len=CONFIG.n_ctx),
    loss=_lm_loss,
    target=partial(_next_tokens, vocab=CONFIG.vocab_size, seq_len=CONFIG.n_ctx),
)
MICRO_BATCH = 2


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYPLAN_PIN_CPUS", "0")  # neither pin nor tune this (pytest's) process
        mp.setenv("PYPLAN_KEEP_HEAP", "0")
        init = Path(tmp_path_factory.mktemp("pg")) / "init"
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_stage_examples_hold_no_memory(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.distributed.optim's torch.jit.script
        from pyplan.runtime import trainer as trainer_module

    given: list[dict[str, Any]] = []

    class Recording(trainer_module.PipelineStage):  # type: ignore[misc, name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            given.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "PipelineStage", Recording)
    points = cut_points(trace(SPEC.build(), SPEC.example_inputs, batch_size=MICRO_BATCH))
    layout = Layout(
        dp=1,
        pp=1,
        micro_batch_size=MICRO_BATCH,
        num_microbatches=2,
        schedule="1F1B",
        cut_positions=(0, len(points.order)),
    )
    torch.manual_seed(0)
    trainer = trainer_module.build_trainer(SPEC, SPEC.build(), layout, trainer_module.optimizer_factory("adamw", 1e-3))
    (kwargs,) = given
    examples = [*kwargs["input_args"], *kwargs["output_args"]]
    logits = MICRO_BATCH * CONFIG.n_ctx * CONFIG.vocab_size * 4
    assert [tuple(t.shape) for t in kwargs["output_args"]] == [(MICRO_BATCH, CONFIG.n_ctx, CONFIG.vocab_size)]
    held = sum(t.untyped_storage().nbytes() for t in examples if not t.is_meta)
    assert held == 0, f"the stage is given {held} bytes of example tensors ({held / logits:.2f} x the logits)"
    # The stage still checks each micro-batch against the examples' strides (contiguous, as step() splits them).
    losses = trainer.step(SPEC.example_inputs(4), SPEC.target(4))
    assert len(losses) == 2 and all(torch.isfinite(x) for x in losses)
