"""`pyplan emit --format torchtitan|deepspeed|megatron`: a plan as the configuration of a trainer the user runs.

Each format names the version of the tool it targets (torchtitan 0.3.0 or its 0.2 line, Megatron-LM's `main`
arguments, DeepSpeed 0.19) and writes every part of the plan (dp, the ZeRO stage, tensor and sequence parallelism,
the pipeline degree, schedule, virtual stages and each stage's boundary, the micro-batch, global batch and
gradient accumulation, the recomputation of each layer, the precision) to the field that makes the tool train as
planned. What the tool cannot express is refused in one line (`PlanError`: `--format X cannot express Y: plan with
--pin Z`); a note is only for what the tool does differently but equivalently.

torchtitan and Megatron-LM build their own models, so this module first finds the plan's model among the decoders
they build (`Decoder`: a Llama, or for Megatron-LM also a GPT-2) and describes the plan in the model's own units
(`PlanShape`): the embeddings, each layer, the final norm and the output head, the units of each pipeline stage
and the recomputation of each layer. The writers (pyplan/emit/torchtitan.py, megatron.py, deepspeed.py) turn that
description into the tool's fields.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from pyplan._torch import meta_build
from pyplan.emit import deepspeed, megatron, torchtitan
from pyplan.emit.planfile import PlanFile
from pyplan.errors import PlanError
from pyplan.graph.linearize import cut_points
from pyplan.graph.trace import trace
from pyplan.load import load_model
from pyplan.plan import Layout
from pyplan.remat_plan import Checkpoint, Keep, Offload, RematItem, Selective, SelectiveCheckpoint

__all__ = [
    "FORMATS",
    "TORCHTITAN_VERSIONS",
    "Decoder",
    "PlanShape",
    "find_decoder",
    "plan_shape",
    "render_config",
    "stage_starts",
]

Notes = list[str]
# What one layer does with its activations, as a tool can say it: keep them, recompute it whole ("full"), recompute
# all but its matrix products and attention ("selective", torchtitan's op policy), move them to the host ("offload"),
# or a mix of these inside the layer that no tool expresses ("mixed").
LayerRemat = Literal["keep", "full", "selective", "offload", "mixed"]
# torchtitan's releases this module writes for: the newest on the package index and the 0.2 line (0.2.0-0.2.2).
TORCHTITAN_VERSIONS = ("0.3", "0.2")


@dataclass(frozen=True)
class Decoder:
    """A decoder-only language model of a family torchtitan or Megatron-LM builds, in the source model's names.

    `family` is "llama" (pre-norm RMSNorm, rotary attention, SwiGLU: torchtitan's llama3 and Megatron's GPT with
    `--normalization RMSNorm --swiglu --position-embedding-type rope`) or "gpt2" (LayerNorm, learned positions,
    GELU: Megatron's GPT with its defaults). `embeddings`, `norm` and `head` are module paths; the layers are
    `stack.0` .. `stack.{n_layers-1}`. `layer_tp` is the tools' tensor-parallel split of one layer (path inside the
    layer -> style), `embedding_tp` and `head_tp` that of the vocabulary-parallel embedding and output."""

    family: Literal["llama", "gpt2"]
    embeddings: tuple[str, ...]
    stack: str
    n_layers: int
    norm: str
    head: str
    tied: bool
    layer_tp: dict[str, str] = field(hash=False)
    embedding_tp: dict[str, str] = field(hash=False)
    head_tp: dict[str, str] = field(hash=False)

    def unit_of(self, module_path: str) -> str | None:
        """The unit a module belongs to: "E" (embeddings), "L<i>" (layer i), "N" (final norm), "H" (output head),
        or None (no module, or one outside these)."""
        if not module_path:
            return None
        inside = _inside(module_path, self.stack)
        if inside is not None:
            index = inside.split(".", 1)[0]
            return f"L{index}" if index.isdigit() else None
        if any(_inside(module_path, e) is not None for e in self.embeddings):
            return "E"
        if _inside(module_path, self.norm) is not None:
            return "N"
        if _inside(module_path, self.head) is not None:
            return "H"
        return None

    def tp_plan(self) -> dict[str, str]:
        """The tools' tensor-parallel plan over the whole model, in the source model's names."""
        plan = {f"{self.stack}.{i}.{k}": v for i in range(self.n_layers) for k, v in self.layer_tp.items()}
        return {**plan, **self.embedding_tp, **self.head_tp}


def _inside(path: str, prefix: str) -> str | None:
    """`path` relative to module `prefix` ("" for the module itself), or None when it is not inside it."""
    if path == prefix:
        return ""
    return path[len(prefix) + 1 :] if path.startswith(prefix + ".") else None


# The Llama layer's split as torchtitan's llama3 `apply_tp` writes it (torchtitan 0.2.2
# torchtitan/models/llama3/infra/parallelize.py) and Megatron's ColumnParallelLinear / RowParallelLinear do it.
_LLAMA_LAYER_TP = {
    "attention.wq": "ColwiseParallel",
    "attention.wk": "ColwiseParallel",
    "attention.wv": "ColwiseParallel",
    "attention.wo": "RowwiseParallel",
    "feed_forward.w1": "ColwiseParallel",
    "feed_forward.w3": "ColwiseParallel",
    "feed_forward.w2": "RowwiseParallel",
}
_HF_LLAMA_LAYER_TP = {
    "self_attn.q_proj": "ColwiseParallel",
    "self_attn.k_proj": "ColwiseParallel",
    "self_attn.v_proj": "ColwiseParallel",
    "self_attn.o_proj": "RowwiseParallel",
    "mlp.gate_proj": "ColwiseParallel",
    "mlp.up_proj": "ColwiseParallel",
    "mlp.down_proj": "RowwiseParallel",
}
_GPT2_LAYER_TP = {
    "attn.c_attn": "ColwiseParallel",
    "attn.c_proj": "RowwiseParallel",
    "mlp.c_fc": "ColwiseParallel",
    "mlp.c_proj": "RowwiseParallel",
}


def find_decoder(model: nn.Module) -> Decoder | None:
    """The model as a decoder torchtitan or Megatron-LM builds, by its module names: Meta's and torchtitan's Llama
    (tok_embeddings, layers.N, norm, output), Hugging Face's LlamaForCausalLM (model.embed_tokens, model.layers.N,
    model.norm, lm_head), or GPT-2 (transformer.wte and wpe, transformer.h.N, transformer.ln_f, lm_head); else None."""
    modules = dict(model.named_modules())

    def has(*paths: str) -> bool:
        return all(p in modules for p in paths)

    def tied(embedding: str, head: str) -> bool:
        return getattr(modules[embedding], "weight", None) is getattr(modules[head], "weight", 0)

    if has("tok_embeddings", "layers", "norm", "output") and isinstance(modules["layers"], nn.ModuleList):
        n = len(modules["layers"])
        if n and all(has(*(f"layers.{i}.{k}" for k in _LLAMA_LAYER_TP)) for i in range(n)):
            return Decoder(
                "llama",
                ("tok_embeddings",),
                "layers",
                n,
                "norm",
                "output",
                tied("tok_embeddings", "output"),
                _LLAMA_LAYER_TP,
                {"tok_embeddings": "RowwiseParallel"},
                {"output": "ColwiseParallel"},
            )
    if type(model).__name__ == "LlamaForCausalLM" and has(
        "model.embed_tokens", "model.layers", "model.norm", "lm_head"
    ):
        n = len(modules["model.layers"])  # type: ignore[arg-type]
        return Decoder(
            "llama",
            ("model.embed_tokens",),
            "model.layers",
            n,
            "model.norm",
            "lm_head",
            tied("model.embed_tokens", "lm_head"),
            _HF_LLAMA_LAYER_TP,
            {"model.embed_tokens": "RowwiseParallel"},
            {"lm_head": "ColwiseParallel"},
        )
    if has("transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head"):
        n = len(modules["transformer.h"])  # type: ignore[arg-type]
        if n and all(has(*(f"transformer.h.{i}.{k}" for k in _GPT2_LAYER_TP)) for i in range(n)):
            return Decoder(
                "gpt2",
                ("transformer.wte", "transformer.wpe"),
                "transformer.h",
                n,
                "transformer.ln_f",
                "lm_head",
                tied("transformer.wte", "lm_head"),
                _GPT2_LAYER_TP,
                {"transformer.wte": "RowwiseParallel"},
                {"lm_head": "ColwiseParallel"},
            )
    return None


@dataclass(frozen=True)
class PlanShape:
    """A plan as the tools see it.

    `decoder` is the model as a decoder the tools build (None: it is not one; `model_name` says which model it is).
    `stages` lists each pipeline stage's units in order ("E", "L<i>", "N", "H", see `Decoder.unit_of`), in the
    global stage order of the layout (stage s on rank s mod pp for looped schedules), one stage without a pipeline,
    none without a decoder. `layer_remat` is each layer's recomputation, `recomputed_outside` the units outside the
    layers that the plan recomputes, `kept_last` the layers the plan keeps as the last of their stage where every
    other layer of that stage is recomputed whole (a tool that recomputes every layer recomputes these too).
    `inside` names the first unit a stage starts inside of (a cut no module-level tool makes), or is empty.
    `embeddings` maps the name of every `nn.Embedding` of the model to the Linear that shares its weight ("" for
    none).
    """

    fmt: str
    doc: PlanFile
    model_name: str
    decoder: Decoder | None
    stages: tuple[tuple[str, ...], ...] = ()
    inside: str = ""
    layer_remat: tuple[LayerRemat, ...] = ()
    recomputed_outside: tuple[str, ...] = ()
    kept_last: tuple[int, ...] = ()
    embeddings: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def layout(self) -> Layout:
        return self.doc.plan.layout

    @property
    def gpus(self) -> int:
        lay = self.layout
        return lay.dp * lay.tp * lay.pp

    def cannot(self, what: str, pin: str) -> PlanError:
        """The one-line refusal of a part of the plan the tool cannot express, with the pins that avoid it."""
        return PlanError(f"--format {self.fmt} cannot express {what}: plan with {pin}")

    def refuse_stages_on_one_rank(self) -> None:
        """Refuse several stages on the only pipeline rank: the tools pipeline over two ranks or more."""
        if self.layout.pp == 1 and self.layout.stages_per_rank > 1:
            raise self.cannot(f"{self.layout.stages_per_rank} pipeline stages on one rank", "--pp 2 or more")

    def built_decoder(self, tool: str, families: Sequence[str]) -> Decoder:
        """The decoder, when the tool builds its family; otherwise the one-line refusal."""
        self.refuse_stages_on_one_rank()
        if self.decoder is None or self.decoder.family not in families:
            kinds = " or ".join({"llama": "a Llama", "gpt2": "a GPT-2"}[f] for f in families)
            raise PlanError(
                f"--format {self.fmt} cannot build {self.model_name}: {tool} trains its own models, and this one is "
                f"not {kinds} under the names pyplan maps to {tool}'s (tok_embeddings, layers.N, norm, output; "
                "Hugging Face's LlamaForCausalLM; GPT-2's transformer.h.N)"
            )
        return self.decoder

    def unit_name(self, unit: str) -> str:
        """A unit in the source model's names ("L3" -> "layers.3")."""
        dec = self.decoder
        assert dec is not None
        if unit.startswith("L"):
            return f"{dec.stack}.{unit[1:]}"
        return {"E": ", ".join(dec.embeddings), "N": dec.norm, "H": dec.head}[unit]

    def remat_kind(self) -> str:
        """The recomputation of every layer in a word: "none", "full", "selective", or "mixed" (layers differ, or a
        layer mixes, or offloads)."""
        kinds = set(self.layer_remat) or {"keep"}
        if kinds == {"keep"}:
            return "none"
        if len(kinds) == 1 and kinds <= {"full", "selective"}:
            return kinds.pop()
        return "mixed"

    def remat_notes(self, tool: str, *, kept_last: bool = True) -> Notes:
        """What a tool that recomputes whole layers does beside the plan: recompute the layers the plan keeps as
        the last of their stage (unless `kept_last` is False: the tool keeps them too), and keep the units outside
        the layers that the plan recomputes."""
        notes = []
        if kept_last and self.kept_last:
            names = ", ".join(self.unit_name(f"L{i}") for i in self.kept_last)
            notes.append(
                f"{tool} recomputes every layer, also {names}, which end a stage and whose activations the plan "
                "keeps there: one more layer's forward per micro-batch, and less memory"
            )
        if self.recomputed_outside:
            names = ", ".join(self.unit_name(u) for u in self.recomputed_outside)
            notes.append(
                f"{tool} recomputes layers only: it keeps the activations of {names}, which the plan recomputes "
                "(their inputs per micro-batch in flight)"
            )
        return notes


def plan_shape(doc: PlanFile, fmt: str, *, trace_model: bool = True) -> PlanShape:
    """The plan as the tools see it: the model as a decoder, each stage's units and each layer's recomputation,
    from the model built on the meta device and traced as the runtime traces it (`trace_model=False`: the decoder
    only)."""
    spec = load_model(doc.model)
    # On the meta device: the names and the graph are needed, not weights (a 70B model would not fit the host).
    with meta_build():
        model = spec.build()
    decoder = find_decoder(model)
    embeddings = _embeddings(model)
    if decoder is None or not trace_model:
        return PlanShape(fmt, doc, doc.model, decoder, embeddings=embeddings)
    lay = doc.plan.layout
    if lay.pp * lay.stages_per_rank == 1 and not lay.remat:
        return PlanShape(fmt, doc, doc.model, decoder, stages=(_all_units(decoder),), embeddings=embeddings)
    graph = trace(model, spec.example_inputs, batch_size=lay.micro_batch_size, leaf_modules=doc.leaf_modules)
    order = cut_points(graph).order
    if lay.stage_of_node:
        index = {name: k for k, name in enumerate(order)}
        order = sorted(order, key=lambda name: (lay.stage_of_node.get(name, 0), index[name]))
    unit = [decoder.unit_of(graph.node(name).module_path) for name in order]
    stages, inside = _stage_units(unit, lay.cut_positions)
    layer_remat, outside, kept_last = _layer_remat(decoder, unit, lay)
    return PlanShape(fmt, doc, doc.model, decoder, stages, inside, layer_remat, outside, kept_last, embeddings)


def _embeddings(model: nn.Module) -> dict[str, str]:
    """Every `nn.Embedding` of the model by name, with the Linear that shares its weight ("" for none)."""
    linears = {id(m.weight): name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return {name: linears.get(id(m.weight), "") for name, m in model.named_modules() if isinstance(m, nn.Embedding)}


def _all_units(dec: Decoder) -> tuple[str, ...]:
    return ("E", *(f"L{i}" for i in range(dec.n_layers)), "N", "H")


def _stage_units(unit: list[str | None], cuts: Sequence[int]) -> tuple[tuple[tuple[str, ...], ...], str]:
    """Each stage's units in order, and the first unit that two stages share (a stage starting inside it)."""
    stages: list[tuple[str, ...]] = []
    owner: dict[str, int] = {}
    inside = ""
    for s in range(len(cuts) - 1):
        units: list[str] = []
        for u in unit[cuts[s] : cuts[s + 1]]:
            if u is None or (units and units[-1] == u):
                continue
            if u in owner and owner[u] != s and not inside:
                inside = u
            owner.setdefault(u, s)
            if u not in units:
                units.append(u)
        stages.append(tuple(units))
    return tuple(stages), inside


def _block_kinds(item: RematItem, inside: str | None = None) -> list[tuple[int, str]]:
    """(block, what the plan does with its activations) for every block an item covers."""
    if isinstance(item, SelectiveCheckpoint):
        return [(b, "selective") for b in item.inner.blocks]
    if isinstance(item, Checkpoint):
        return [kb for it in item.inner.items for kb in _block_kinds(it, "full")]
    if isinstance(item, Offload):
        return [(item.block, "offload")]
    if isinstance(item, Selective):
        return [(item.block, "selective")]
    assert isinstance(item, Keep)
    return [(item.block, inside or "keep")]


def _layer_remat(
    dec: Decoder, unit: list[str | None], lay: Layout
) -> tuple[tuple[LayerRemat, ...], tuple[str, ...], tuple[int, ...]]:
    """Each layer's recomputation, the units outside the layers the plan recomputes, and the layers kept as the
    last of their stage where the rest of the stage is recomputed whole (see `PlanShape`)."""
    kinds: dict[str, set[str]] = {}
    last_of_stage: dict[str, int] = {}  # unit -> stage, for the units of a stage's last block
    for s, stage in enumerate(lay.remat):
        if stage is None:
            continue
        blocks = stage.plan.items
        for block, kind in (kb for it in blocks for kb in _block_kinds(it)):
            units = {u for u in unit[stage.positions[block] : stage.positions[block + 1]] if u is not None}
            for u in units:
                kinds.setdefault(u, set()).add(kind)
                if block == stage.plan.last and kind == "keep":
                    last_of_stage[u] = s
    per_layer: list[LayerRemat] = []
    kept_last: list[int] = []
    for i in range(dec.n_layers):
        ks = kinds.get(f"L{i}", {"keep"})
        per_layer.append(_one_layer(ks))
    # A layer kept (wholly or in its last block) only because it ends its stage, in a stage whose other layers are
    # recomputed whole, counts as recomputed: the tools recompute whole layers, this one too.
    for s in set(last_of_stage.values()):
        layers = sorted(int(u[1:]) for u, st in last_of_stage.items() if st == s and u.startswith("L"))
        if not layers:
            continue
        last = layers[-1]
        others = [per_layer[i] for i in _stage_layers(unit, lay, s) if i != last]
        recomputed = bool(others) and all(k == "full" for k in others)
        if recomputed and per_layer[last] != "full" and kinds.get(f"L{last}", set()) <= {"full", "keep"}:
            kept_last.append(last)
            per_layer[last] = "full"
    # The embeddings keep only their token ids whether recomputed or not: only the final norm and the head count.
    outside = tuple(u for u in ("N", "H") if kinds.get(u, {"keep"}) - {"keep"})
    return tuple(per_layer), outside, tuple(sorted(kept_last))


def _stage_layers(unit: list[str | None], lay: Layout, s: int) -> list[int]:
    units = {u for u in unit[lay.cut_positions[s] : lay.cut_positions[s + 1]] if u is not None and u.startswith("L")}
    return sorted(int(u[1:]) for u in units)


def _one_layer(kinds: set[str]) -> LayerRemat:
    if "offload" in kinds:
        return "offload"
    if kinds == {"keep"}:
        return "keep"
    if kinds == {"full"}:
        return "full"
    if kinds <= {"selective", "keep"}:
        return "selective"
    return "mixed"


def stage_starts(doc: PlanFile) -> tuple[list[str], Notes]:
    """The module each pipeline stage after the first starts at, in the source model's names, from the model traced
    as the runtime traces it; where a stage starts inside a module, that module and a note."""
    lay = doc.plan.layout
    if lay.pp == 1 and lay.stages_per_rank == 1:
        return [], []
    spec = load_model(doc.model)
    with meta_build():
        model = spec.build()
    graph = trace(model, spec.example_inputs, batch_size=lay.micro_batch_size, leaf_modules=doc.leaf_modules)
    points = cut_points(graph)
    nodes = {n.name: n for n in graph.nodes}
    starts, notes = [], []
    for position in lay.cut_positions[1:-1]:
        first = nodes[points.order[position]].module_path
        before = nodes[points.order[position - 1]].module_path if position > 0 else ""
        module = _layer_of(first)
        starts.append(module)
        if before == module or before.startswith(module + "."):
            notes.append(f"a stage starts inside {module}: tools that split at modules start it at {module}")
    return starts, notes


def _layer_of(path: str) -> str:
    """The outermost numbered module on `path` ("layers.4.attention.wq" -> "layers.4"), else the path itself."""
    match = re.match(r"^(.*?\.\d+)(\.|$)", path)
    return match.group(1) if match else path


def _torchtitan(doc: PlanFile, version: str) -> tuple[str, Notes]:
    return torchtitan.render(plan_shape(doc, "torchtitan"), version)


def _deepspeed(doc: PlanFile, version: str) -> tuple[str, Notes]:
    return deepspeed.render(plan_shape(doc, "deepspeed", trace_model=False))


def _megatron(doc: PlanFile, version: str) -> tuple[str, Notes]:
    return megatron.render(plan_shape(doc, "megatron"))


FORMATS: dict[str, Callable[[PlanFile, str], tuple[str, Notes]]] = {
    "torchtitan": _torchtitan,
    "deepspeed": _deepspeed,
    "megatron": _megatron,
}


def render_config(doc: PlanFile, fmt: str, *, torchtitan_version: str = TORCHTITAN_VERSIONS[0]) -> tuple[str, Notes]:
    """The plan in another tool's configuration format, and the notes on what the tool does differently but
    equivalently; a plan the tool cannot express is refused (PlanError, one line)."""
    if fmt not in FORMATS:
        raise PlanError(f"unknown format '{fmt}'; choose one of {', '.join(FORMATS)} (or leave it out for train.py)")
    if torchtitan_version not in TORCHTITAN_VERSIONS:
        raise PlanError(
            f"unknown torchtitan version '{torchtitan_version}'; choose one of {', '.join(TORCHTITAN_VERSIONS)}"
        )
    return FORMATS[fmt](doc, torchtitan_version)
