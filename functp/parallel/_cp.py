"""Context parallelism for transformers models by plan: on a mesh with a ``cp`` axis,
``apply`` takes whole sequences, gives each rank its block of every sequence tensor
(token ids, embeddings, positions, the padding mask, labels) in the causal
load-balanced layout, and runs the model's attention as :func:`functp.attention`
over ``cp``.

The attention is swapped through transformers' own attention-function registry
(``AttentionInterface``): the function is registered once under :data:`NAME`, and
the model's ``config._attn_implementation`` names it only while ``apply`` runs, so
the unsharded module (kept for reference checks) runs its own attention. Nothing
of torch or transformers is patched.

transformers' mask functions do not know :data:`NAME`, so the model builds no
sequence-local mask: the mask comes from every token's original position
(causal, the layer's sliding window), with padding and packed documents
(``position_ids`` that restart) as documents over the whole sequence.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..context_parallel._attention import STRATEGIES, attend
from ..context_parallel._layout import check_length, layout_positions
from ..mesh._mesh import Mesh
from ..ops._collectives import axis_index, axis_size, psum, pvary
from ..runtime._errors import ShardingError
from . import _replayed

__all__ = ["ContextParallel", "NAME", "context_parallel_of"]

#: the name functp's attention is registered under in transformers' registry
NAME = "functp_context_parallel"

# the call in progress on this thread (functp.simulate runs its ranks as threads)
_ACTIVE = threading.local()

# the sequence arguments of a transformers model's forward, and where their
# sequence dimension is
_SEQUENCE = {"input_ids": 1, "inputs_embeds": 1, "position_ids": 1, "labels": 1,
             "token_type_ids": 1}
_IGNORE = -100          # transformers' (and torch's cross_entropy's) ignore_index


class ContextParallel:
    """The plan family of a ``cp`` axis: a transformers model's sequence split over
    ``axis``, its attention :func:`functp.attention` with ``strategy``.

    ``parallelize(model, mesh, plan)`` / :func:`functp.from_pretrained` use one with
    the default strategy on any mesh with a ``cp`` axis; pass it as a plan family to
    choose another: ``{"tp": "auto"-plan or rules, "cp": ContextParallel("ulysses")}``
    (with ``"auto"``, ``{"cp": ...}`` alone).

    ``apply`` then takes *whole* sequences (their in_specs do not name ``cp``) and
    returns this rank's block of the outputs (``logits`` ``(batch, seq / cp,
    vocab)``, tokens in the layout's order: :meth:`block` of a whole-sequence tensor
    is the matching block); ``loss`` (with ``labels``) is the unsharded model's: the
    labels are shifted over the whole sequence, then split, and each rank's sum
    over its tokens is divided by the whole batch's count of labelled tokens and
    summed over ``cp``.

    **Arguments:** ``strategy`` – ``"allgather"``, ``"ulysses"`` or ``"ring"``
    (``docs/long_sequences.md``); ``axis`` – the mesh axis; ``balanced`` – the causal
    load-balanced layout (rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``), or
    contiguous blocks.

    Example (4 processes)::

        mesh = functp.make_mesh((2, 2), ("cp", "tp"))
        apply, params, specs = functp.parallelize(model, mesh, "auto")
        step = functp.shard_map(lambda p, i, y: apply(p, input_ids=i, labels=y).loss,
                                mesh, in_specs=(specs, P(), P()), out_specs=P())
        loss = step(params, ids, ids)      # the unsharded model's loss
    """

    def __init__(self, strategy: str = "allgather", *, axis: str = "cp", balanced: bool = True):
        if strategy not in STRATEGIES:
            raise ShardingError(f"ContextParallel: strategy={strategy!r} is not one of "
                                f"{STRATEGIES}")
        self.strategy, self.axis, self.balanced = strategy, axis, bool(balanced)
        self.size = None

    def __repr__(self) -> str:
        return (f"ContextParallel({self.strategy!r}, axis={self.axis!r}, "
                f"balanced={self.balanced})")

    def bind(self, module: nn.Module, mesh: Mesh, specs: dict) -> "ContextParallel":
        """Checks ``module`` and ``mesh`` at parallelize time (the same on every rank)
        and registers the attention function; returns a copy bound to the mesh."""
        kind = type(module).__name__
        if self.axis not in mesh.axis_names:
            raise ShardingError(f"ContextParallel over {self.axis!r}: not an axis of {mesh}")
        if not _attention_by_config(module):
            raise ShardingError(
                f"parallelize: ContextParallel over {self.axis!r} splits a transformers "
                f"model's sequence, but {kind} has no transformers config "
                f"(config._attn_implementation); for your own model, leave "
                f"ContextParallel out of the plan, call functp.attention in its "
                f"attention and functp.cp_shard its inputs")
        out = ContextParallel(self.strategy, axis=self.axis, balanced=self.balanced)
        out.size = mesh.axis_size(self.axis)
        if out.strategy == "ulysses":
            _check_heads(module, mesh, specs, out)
        from transformers import AttentionInterface
        AttentionInterface.register(NAME, _attention)
        return out

    def block(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's block of a whole-sequence tensor ``x`` (the same on every rank),
        in the layout ``apply`` gives its outputs: inside the shard_map body, e.g. the
        targets of a loss written over ``logits``. Varying over the axis."""
        n, me = axis_size(self.axis), axis_index(self.axis)
        s = x.shape[dim]
        check_length(s, n, self.balanced, f"ContextParallel.block: dim {dim} of a tensor "
                                          f"of shape {tuple(x.shape)}")
        blk = s // n
        idx = layout_positions(s, n, self.balanced)[me * blk:(me + 1) * blk].to(x.device)
        return pvary(x, self.axis).index_select(dim, idx)

    def __call__(self, apply, params: dict, args: tuple, kwargs: dict) -> Any:
        """``apply``'s call: the planned module on this rank's blocks of the sequence
        arguments, with the attention swapped; the loss summed over the axis."""
        module = apply.module
        kind = type(module).__name__
        kw = _bound(module, args, kwargs)
        ax = self.axis
        if kw.get("past_key_values") is not None or kw.get("use_cache"):
            raise ShardingError(
                f"apply of parallelize({kind}) over {ax!r}: a key/value cache "
                f"(past_key_values, use_cache=True) cannot be split over the sequence; "
                f"pass use_cache=False (training and scoring whole sequences)")
        if "use_cache" in inspect.signature(module.forward).parameters:
            kw["use_cache"] = False
        lead = kw.get("input_ids")
        lead = kw.get("inputs_embeds") if lead is None else lead
        if not isinstance(lead, torch.Tensor) or lead.ndim < 2:
            raise ShardingError(
                f"apply of parallelize({kind}) over {ax!r}: needs input_ids (batch, seq) "
                f"or inputs_embeds (batch, seq, hidden) of whole sequences")
        b, s = lead.shape[:2]
        n = axis_size(ax)
        check_length(s, n, self.balanced, f"apply of parallelize({kind}) over {ax!r} "
                                          f"(input of shape {tuple(lead.shape)})")
        mask, pos = kw.pop("attention_mask", None), kw.get("position_ids")
        for name, t in (("attention_mask", mask), *((k, kw.get(k)) for k in _SEQUENCE)):
            if isinstance(t, torch.Tensor) and (t.ndim < 2 or t.shape[1] != s):
                raise ShardingError(
                    f"apply of parallelize({kind}) over {ax!r}: {name} of shape "
                    f"{tuple(t.shape)} is not a whole sequence of {s} tokens at dim 1; "
                    f"pass whole sequences (the same on every {ax!r} rank; apply splits "
                    f"them){' (a 2-d padding mask)' if name == 'attention_mask' else ''}")
        if isinstance(mask, torch.Tensor) and mask.ndim != 2:
            raise ShardingError(
                f"apply of parallelize({kind}) over {ax!r}: attention_mask of shape "
                f"{tuple(mask.shape)}: only a 2-d padding mask (batch, seq) can be split "
                f"over the sequence; give packed documents as position_ids that restart")
        docs = _documents(mask, pos, b, s)
        labels = kw.get("labels")
        if labels is not None:
            # shifted over the whole sequence: a block's last token predicts the next
            # block's first, which another rank holds
            shift = F.pad(labels[:, 1:], (0, 1), value=_IGNORE)
            kw["num_items_in_batch"] = (shift != _IGNORE).sum()
            kw["shift_labels"] = self.block(shift)
        if pos is None:
            # the rotary embedding's positions: the tokens' places in the whole sequence
            kw["position_ids"] = torch.arange(s, device=lead.device)[None]
        for name in _SEQUENCE:
            if isinstance(kw.get(name), torch.Tensor):
                kw[name] = self.block(kw[name])
        call = _Call(self, None if docs is None else docs.index_select(
            1, layout_positions(s, n, self.balanced).to(docs.device)))
        config = module.config
        was, prev = config._attn_implementation, getattr(_ACTIVE, "call", None)
        config._attn_implementation, _ACTIVE.call = NAME, call
        try:
            out = _replayed.call(apply, params, (), kw, lambda p: apply._run(p, (), kw))
        finally:
            config._attn_implementation, _ACTIVE.call = was, prev
        loss = getattr(out, "loss", None)
        if labels is not None and isinstance(loss, torch.Tensor):
            out["loss"] = psum(loss, ax)       # each rank's sum / the whole count
        return out


class _Call:
    """What the attention function needs of the call in progress."""

    def __init__(self, cp: ContextParallel, docs: torch.Tensor | None):
        self.cp, self.docs = cp, docs


def _bound(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (positional ones bound to ``forward``'s names)."""
    if not args:
        return dict(kwargs)
    sig = inspect.signature(module.forward)
    try:
        bound = sig.bind_partial(*args, **kwargs).arguments
    except TypeError as e:
        raise ShardingError(f"apply of parallelize({type(module).__name__}): {e}") from e
    out = {}
    for name, value in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif sig.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            raise ShardingError(f"apply of parallelize({type(module).__name__}) over cp: "
                                f"pass the arguments by name (input_ids=...)")
        else:
            out[name] = value
    return out


def _documents(mask, position_ids, b: int, s: int) -> torch.Tensor | None:
    """Every token's document over the whole sequence ``(b, s)`` in its own order, as
    transformers masks it, or ``None`` (neither a padding mask nor positions given):
    with a padding mask, each padded token is its own document (no real token sees
    it; it sees itself); without one, the packed documents of ``position_ids``, as
    transformers' ``find_packed_sequence_indices`` counts them (a new document where
    the positions do not step by 1). Never ``None`` for data that happens to hold
    one document: the path must not depend on the values (the ranks of another axis
    hold other sequences)."""
    if isinstance(mask, torch.Tensor):
        own = -1 - torch.arange(b * s, device=mask.device).view(b, s)
        return torch.where(mask.to(torch.bool), torch.zeros_like(own), own)
    if isinstance(position_ids, torch.Tensor):
        pos = position_ids.expand(b, -1)
        step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
        return (step != 1).cumsum(-1)
    return None


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
               scaling: float | None = None, sliding_window: int | None = None,
               softcap: float | None = None, is_causal: bool | None = None,
               s_aux: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over :func:`functp.attention`:
    ``query``/``key``/``value`` ``(batch, heads, seq / cp, head_dim)``, the output
    ``(batch, seq / cp, heads, head_dim)``."""
    call = getattr(_ACTIVE, "call", None)
    kind = type(module).__name__
    if call is None:
        raise ShardingError(
            f"{kind}: config._attn_implementation is {NAME!r} (functp's context-parallel "
            f"attention) outside an apply of functp.parallelize over a cp axis; set it "
            f"back to 'sdpa' or 'eager' for the unsharded model")
    cp = call.cp
    why = [w for w, bad in (
        (f"dropout={dropout} (pass model.eval() or attention_dropout=0)", dropout),
        ("attention sinks (s_aux)", s_aux is not None),
        ("a mask the model built itself", attention_mask is not None)) if bad]
    if why:
        raise ShardingError(
            f"{kind} over {cp.axis!r}: functp's context-parallel attention does not "
            f"apply {', '.join(why)}; use a mesh without {cp.axis!r} for this model")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attend(query, key, value, cp.axis, strategy=cp.strategy, causal=bool(causal),
                 balanced=cp.balanced, window=sliding_window, docs=call.docs,
                 scale=scaling, checked=False, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def _check_heads(module: nn.Module, mesh: Mesh, specs: dict, cp: ContextParallel) -> None:
    """Ulysses splits each rank's query heads over cp: refused at parallelize time,
    naming the sizes and the fix, where they do not divide."""
    config = module.config
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    q = next((n for n in specs if n.endswith("q_proj.weight")), None)
    tp = mesh.axis_size(specs[q].dim_axes(0)) if q is not None and specs[q].dim_axes(0) else 1
    local = heads // tp
    if local % cp.size:
        raise ShardingError(
            f"parallelize({type(module).__name__}): strategy='ulysses' splits each "
            f"rank's {local} query heads ({heads} heads{f' / tp {tp}' if tp > 1 else ''}) "
            f"over {cp.axis!r} (size {cp.size}), which does not divide them; use a "
            f"{cp.axis!r} size that divides {local}, or ContextParallel('allgather') or "
            f"ContextParallel('ring')")


def context_parallel_of(module: nn.Module, mesh: Mesh, plan: Any
                        ) -> tuple[Any, ContextParallel | None]:
    """``(plan without its cp family, the ContextParallel)``: the plan's ``"cp"``
    family, or, on a mesh with a ``cp`` axis, the default one for a transformers
    model; ``(plan, None)`` otherwise (a model of the user's own that calls
    functp.attention itself keeps its ``cp`` axis as any other)."""
    cp = None
    if isinstance(plan, dict):
        fams = [k for k, v in plan.items() if isinstance(v, ContextParallel)]
        if fams:
            cp = plan[fams[0]]
            if fams[0] != cp.axis:
                raise ShardingError(f"parallelize: plan family {fams[0]!r} holds {cp!r}; "
                                    f"key it by its axis {cp.axis!r}")
            plan = {k: v for k, v in plan.items() if k not in fams} or "auto"
    if cp is None and "cp" in mesh.axis_names and _attention_by_config(module):
        cp = ContextParallel()
    return plan, cp


def _attention_by_config(module: nn.Module) -> bool:
    """Does ``module`` choose its attention by ``config._attn_implementation`` (a
    transformers model), where ContextParallel swaps it in?"""
    return hasattr(getattr(module, "config", None), "_attn_implementation")
