"""Attention masks that depend on no input: a causal mask becomes `is_causal=True`, an all-open mask none.

Hugging Face models run eagerly drop such a mask before they call `scaled_dot_product_attention` (transformers'
`sdpa_mask` with `allow_is_causal_skip`), so that a GPU runs the flash kernel, which takes no mask. Captured, the
same models build the mask out of aranges and the batch size and pass it: the flash kernel could not run, and the
memory-efficient one would save the mask beside Q, K and V. The pass below evaluates each such mask on the CPU
(it depends on no model input, so its values are those of every batch) and, where it is exactly causal or exactly
open, gives the call what the eager model gives it. The graph computes the same thing after as before.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

__all__ = ["SDPA_TARGETS", "is_batch_size", "sdpa_arguments", "simplify_attention_masks"]

SDPA_TARGETS = (
    torch.nn.functional.scaled_dot_product_attention,
    torch._C._nn.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# A mask larger than this many elements is left alone: evaluating it would cost real memory.
_MAX_MASK_ELEMENTS = 1 << 28


def is_batch_size(n: fx.Node) -> bool:
    """Whether `n` reads the batch size off a model input: `aten.sym_size.int(input, 0)` of an exported graph."""
    return (
        n.op == "call_function"
        and n.target is torch.ops.aten.sym_size.int
        and n.args[1] == 0
        and isinstance(n.args[0], fx.Node)
        and n.args[0].op == "placeholder"
    )


def sdpa_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a `scaled_dot_product_attention` call by name, defaults filled in."""
    named = dict(zip(_PARAMS, args))
    named.update(kwargs)
    for key, default in (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None)):
        named.setdefault(key, default)
    named.setdefault("enable_gqa", False)
    return named


def _ancestors(node: fx.Node) -> Iterator[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        if not is_batch_size(n):
            stack.extend(n.all_input_nodes)


def _evaluate(gm: fx.GraphModule, mask: fx.Node) -> torch.Tensor | None:
    """The mask's value at a batch of one, or None where it depends on an input or on a weight not at hand."""
    needed = set(_ancestors(mask))
    env: dict[fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n not in needed:
            continue
        if is_batch_size(n):
            env[n] = 1
        elif n.op == "placeholder":
            return None
        elif n.op == "get_attr":
            value = operator.attrgetter(str(n.target))(gm)
            if isinstance(value, torch.nn.Parameter) or (
                isinstance(value, torch.Tensor) and value.device.type == "meta"
            ):
                return None  # a mask made of weights is learned: zero today, not tomorrow
            env[n] = value
        elif n.op == "call_function":
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
        else:  # a module call: not evaluated here
            return None
        value = env[n]
        if isinstance(value, torch.Tensor) and value.numel() > _MAX_MASK_ELEMENTS:
            return None
    value = env.get(mask)
    return value if isinstance(value, torch.Tensor) else None


def _kind(mask: torch.Tensor, q_len: int, k_len: int) -> str | None:
    """ "open" (every key seen), "causal" (the lower triangle, as is_causal) or None (any other pattern)."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (q_len, k_len):
        return None
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= -1e4)).all()):
        return None  # an additive bias, not a mask
    if bool(allowed.all()):
        return "open"
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=mask.device).tril()
    if q_len == k_len and bool((allowed == causal).all()):
        return "causal"
    return None


def _lengths(query: Any, key: Any, mask: torch.Tensor) -> tuple[int, int]:
    """The query and key lengths: from the capture's shapes where it recorded them (torch.export), else the mask's
    own last two sizes (a mask broadcasts only over sizes of 1, so a square one is the attention's)."""
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in (query, key)]
    if all(isinstance(v, torch.Tensor) for v in vals):
        return int(vals[0].shape[-2]), int(vals[1].shape[-2])
    return int(mask.shape[-2]), int(mask.shape[-1])


def simplify_attention_masks(gm: fx.GraphModule) -> int:
    """Rewrite each attention call of `gm` whose mask depends on no input and is exactly causal or open; returns
    how many were rewritten."""
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in SDPA_TARGETS:
            continue
        named = sdpa_arguments(n.args, dict(n.kwargs))
        mask, query, key = named["attn_mask"], named["query"], named["key"]
        if not isinstance(mask, fx.Node) or named["is_causal"]:
            continue
        try:
            with torch.no_grad():
                value = _evaluate(gm, mask)
                kind = None if value is None else _kind(value, *_lengths(query, key, value))
        except Exception:  # an op that needs what the capture had and the CPU has not: keep the mask
            kind = None
        if kind is None:
            continue
        named["attn_mask"] = None
        named["is_causal"] = kind == "causal"
        n.args = (named.pop("query"), named.pop("key"), named.pop("value"))
        n.kwargs = {k: v for k, v in named.items() if not (k == "enable_gqa" and v is False)}
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed
