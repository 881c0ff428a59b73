"""``functp.resize_token_embeddings``: a transformers model's vocabulary grown (or
shrunk) after ``parallelize`` or ``from_pretrained``, on the blocks.

``model.resize_token_embeddings`` cannot act on the blocks: it swaps new embedding
modules into the module (or refills the old ones) while the blocks keep the old rows,
and with its default ``mean_resizing=True`` it reads the old rows' mean and
covariance, which a released (meta) module does not hold. Here the embedding and an
untied LM head are gathered whole from the blocks (one all-gather each, on every
rank), put into the module, and resized by transformers' own method, so the new rows
are transformers' (``mean_resizing`` from the trained rows, or the model's
``_init_weights``, from the global random state); rank 0's new rows are broadcast,
since the ranks' random states may differ; then the module is laid out again with the
plan it was laid out with: the vocabulary stays split as before. Every other block is
the one given, unchanged (the same tensor object: its optimizer state could carry
over, but the embedding's could not, so an optimizer is built after the resize).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..runtime import _world
from ..runtime._errors import ShardingError
from ._kept import _trained, _vocab_modules
from ._parallelize import parallelize
from ._plans import Parallelized

__all__ = ["resize_token_embeddings"]


def resize_token_embeddings(apply: Parallelized, params: dict[str, torch.Tensor],
                            new_num_tokens: int | None = None, *,
                            pad_to_multiple_of: int | None = None, mean_resizing: bool = True
                            ) -> tuple[Parallelized, dict[str, torch.Tensor], dict[str, Any]]:
    """transformers' ``model.resize_token_embeddings`` for a parallelized model.

    Call it on every rank, outside any ``shard_map`` body, before building the
    optimizer. The new rows are what ``model.resize_token_embeddings(new_num_tokens,
    pad_to_multiple_of, mean_resizing)`` gives on the unsharded model holding the
    blocks' weights (rank 0's random state draws them);
    ``apply.module.config.vocab_size`` becomes the new size, so
    :func:`functp.save_pretrained` writes a config that agrees with the tensors.

    **Arguments:** ``apply``, ``params`` – from :func:`functp.parallelize` or
    :func:`functp.from_pretrained` of a transformers model (the blocks, trained or
    not); ``new_num_tokens``, ``pad_to_multiple_of``, ``mean_resizing`` – as
    transformers' (a split vocabulary's new size must divide by the axes it is split
    over: ``pad_to_multiple_of`` rounds it up).

    **Returns:** ``(apply, params, specs)`` for the resized model: a new ``apply``
    (the old one refuses its next call), the resized embedding and LM head blocks
    (requiring grad where the given ones did) and every other block as given.

    Example (``torchrun --nproc-per-node 2``)::

        apply, params, specs = functp.from_pretrained("my-llama", mesh)
        apply, params, specs = functp.resize_token_embeddings(apply, params, 32_008,
                                                              pad_to_multiple_of=8)
        apply.module.config.vocab_size                # 32008
    """
    module = apply.module
    vocab = _vocab_params(apply, params)
    emb = module.get_input_embeddings()
    old_rows = emb.weight.shape[0]
    rows = _new_rows(new_num_tokens, pad_to_multiple_of, old_rows)
    if rows == old_rows:
        return apply, params, dict(apply.specs)
    _check_divides(apply, vocab, rows, pad_to_multiple_of)
    stale = _trained(module) if getattr(module, "_functp_guarded", None) else None
    full = apply.unshard({n: params[n].detach() for n in vocab})      # (every rank)
    for n, p in vocab.items():
        _replace(module, p, nn.Parameter(full[n], requires_grad=p.requires_grad))
    apply._released = False       # (its forward pre-hook would refuse the new apply's calls)
    module.resize_token_embeddings(new_num_tokens, pad_to_multiple_of=pad_to_multiple_of,
                                   mean_resizing=mean_resizing)
    _agree_new_rows(module, old_rows)
    new, blocks, specs = parallelize(module, apply.mesh, **apply._laid_out)
    resized = set(_vocab_names(module))
    out = {}
    for k, spec in specs.items():
        if k in resized:
            out[k] = blocks[k].requires_grad_(params[k].requires_grad) if k in params \
                else blocks[k]
        elif k not in params or apply.specs.get(k) != spec:
            raise ShardingError(
                f"resize_token_embeddings: after the resize, parameter {k!r} is laid out "
                f"as {spec} (it was {apply.specs.get(k)}); only the embedding and LM "
                f"head may change: resize the unsharded model, then parallelize it")
        else:
            out[k] = params[k]
    if stale is not None:
        ref, versions = module._functp_guarded
        module._functp_guarded = (ref, [(b, -1) for b, _ in versions])   # (still stale)
    return new, out, specs


def _vocab_names(module: nn.Module) -> list[str]:
    """The canonical names of the embedding's and LM head's own parameters."""
    canon = {id(p): n for n, p in module.named_parameters()}
    return list(dict.fromkeys(canon[id(p)] for m in _vocab_modules(module)
                              for p in m.parameters(recurse=False)))


def _vocab_params(apply: Parallelized, params: dict) -> dict[str, nn.Parameter]:
    """Name -> the module's parameter, for the embedding and LM head; raises unless
    ``apply`` is a parallelized transformers model whose blocks ``params`` holds."""
    module = apply.module
    if not (isinstance(apply, Parallelized) and callable(getattr(module, "resize_token_embeddings",
                                                                 None))):
        raise ShardingError(
            f"resize_token_embeddings: expected the apply of functp.parallelize or "
            f"functp.from_pretrained of a transformers model, got {apply!r}; for another "
            f"module, change it before parallelize")
    if not hasattr(apply, "_laid_out"):
        raise ShardingError(f"resize_token_embeddings: {apply!r} was not laid out by "
                            f"functp.parallelize; resize the model, then parallelize it")
    by_name = dict(module.named_parameters())
    names = _vocab_names(module)
    missing = [n for n in names if n not in params]
    if missing:
        raise ShardingError(
            f"resize_token_embeddings: params lacks {missing} (the embedding's and LM "
            f"head's blocks); give the params dict parallelize/from_pretrained returned")
    return {n: by_name[n] for n in names}


def _new_rows(n: int | None, multiple: int | None, old: int) -> int:
    """The size transformers resizes to (``_get_resized_embeddings``' rounding)."""
    if multiple is None:
        return old if n is None else n
    if not isinstance(multiple, int) or multiple <= 0:
        raise ShardingError(f"resize_token_embeddings: pad_to_multiple_of={multiple!r} "
                            f"must be a positive int")
    n = old if n is None else n
    return (n + multiple - 1) // multiple * multiple


def _check_divides(apply: Parallelized, vocab: dict, rows: int, multiple: int | None) -> None:
    """Refuses, before anything changes, a size the vocabulary's split does not divide."""
    for n in vocab:
        spec = apply.specs[n]
        entry = spec[0] if len(spec) else None
        size = 1
        for ax in (entry if isinstance(entry, tuple) else (entry,) if entry else ()):
            size *= apply.mesh.axis_size(ax)
        if rows % size:
            raise ShardingError(
                f"resize_token_embeddings: {n!r} is split over {entry!r} ({size} ranks, "
                f"spec {spec}), so its new size {rows} must divide by {size}; pass "
                f"pad_to_multiple_of={size} (or a multiple of it), as transformers takes it"
                + (f" (pad_to_multiple_of={multiple} gave {rows})" if multiple else ""))


def _replace(module: nn.Module, old: torch.Tensor, new: nn.Parameter) -> None:
    """``new`` in every slot of ``module`` holding ``old`` (a tied weight has two)."""
    for mod in module.modules():
        for short, p in list(mod._parameters.items()):
            if p is old:
                mod._parameters[short] = new


def _agree_new_rows(module: nn.Module, old_rows: int) -> None:
    """Rank 0's new rows on every rank (each rank drew its own)."""
    if _world.process_count() == 1:
        return
    with torch.no_grad():
        for n in _vocab_names(module):
            p = dict(module.named_parameters())[n]
            if p.shape[0] > old_rows:
                new = p[old_rows:]
                new.copy_(_world.broadcast(new.contiguous(), 0))
