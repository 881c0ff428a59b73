"""What the FSDP plan-family tests share: their meshes, the loss, the gather groups
of the default rule written out (the oracle for the collectives' counts), the
modules an ``fsdp_plan`` names, and one step under a plan against the unsharded
float64 model."""
from __future__ import annotations

import fnmatch
import warnings

import torch

import functp
from functp import P

_MESHES = {"fsdp2": ((2,), ("fsdp",)), "fsdp4": ((4,), ("fsdp",)),
           "replicate2_fsdp2": ((2, 2), ("dp_replicate", "fsdp")),
           "fsdp2_tp2": ((2, 2), ("fsdp", "tp"))}


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _max_error(actual: dict, expected: dict) -> float:
    return max((actual[k] - v).abs().max().item() / max(v.abs().max().item(), 1e-12)
               for k, v in expected.items())


def _groups(model, specs, plan=None, axis="fsdp") -> dict[str, str]:
    """The FSDP gather groups of the default rule, written out: each module owning a
    parameter split over ``axis`` -> the deepest module holding it that is an item of
    an ``nn.ModuleList`` or a unit of transformers' ``fsdp_plan`` ``plan``
    (:func:`_units`), else the group of the module whose parameters it shares
    (tied), else the root ("")."""
    lists = {f"{n}.{c}" if n else c for n, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) for c, _ in m.named_children()}
    units = {**{n: n for n in lists}, **_units(model, plan or {})}
    canon, out = {id(p): n for n, p in model.named_parameters()}, {}     # (tied: once)

    def holder(name):
        parts = name.split(".") if name else []
        return next((units[h] for h in (".".join(parts[:k]) for k in range(len(parts), 0, -1))
                     if h in units), "")
    for name, mod in model.named_modules():
        own = list(mod.parameters(recurse=False))
        if any(axis in specs[canon[id(p)]].axes for p in own):
            out[name] = holder(name)
            owners = {canon[id(p)].rpartition(".")[0] for p in own}
            if out[name] == "" and len(owners) == 1 and name not in owners:
                out[name] = holder(owners.pop())
    return out


def _units(model, plan) -> dict[str, str]:
    """transformers' FSDP2 units of ``plan`` ({module pattern: free/keep}): each module
    a pattern names -> itself, but the final norm and the output head (or the input
    embedding, which a tied head's rule moves to) -> one name when exactly they two
    are kept (``apply_fully_sharded_data_parallelism`` wraps that pair in one
    ``fully_shard``)."""
    how = {}
    for n in _named(model, plan):
        how[n] = next(h for p, h in plan.items() if _named_by(n, p))
    names = {id(m): n for n, m in model.named_modules()}
    ends = [names.get(id(getattr(model, g)())) if hasattr(model, g) else None
            for g in ("get_input_embeddings", "get_output_embeddings")]
    if getattr(model, "all_tied_weights_keys", None) and None not in ends:
        how.pop(ends[0], None)
        if how.get(ends[1]) == "keep_full_weight":
            del how[ends[1]]
            how[ends[0]] = "keep_full_weight"
    kept = sorted(n for n, h in how.items() if h == "keep_full_weight")
    units = {n: n for n in how}
    if (len(kept) == 2 and any(n.split(".")[-1] == "norm" for n in kept)
            and any(n in ends for n in kept)):
        units.update({n: "tail" for n in kept})
    return units


def _step(model, mesh, plan, tape, forward, distributed_config=None):
    """One step under the plan: (loss, full gradients, forward log, whole-step log,
    specs, apply), and the unsharded float64 reference (loss, gradients)."""
    g = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(3, 32, (8, 6), generator=g), torch.randint(32, (8, 6), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply, params, specs = functp.parallelize(model, mesh, plan,
                                                  distributed_config=distributed_config)
    batch = apply.batch_axes
    local = functp.shard((ids, tgt), apply.mesh, P(batch))
    step = functp.shard_map(lambda p, i, t: functp.pmean(_loss(forward(apply, p, i), t), batch),
                            apply.mesh, in_specs=(specs, P(batch), P(batch)), out_specs=P())
    if not tape:
        with functp.comm_log() as fwd:      # the forward alone
            step(params, *local)
    with functp.comm_log() as log:
        if tape:
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            with functp.comm_log() as fwd:
                loss = step(p, *local)
            loss.backward()
            grads = {k: v.grad for k, v in p.items()}
        else:
            grads, loss = torch.func.grad_and_value(step)(params, *local)
    ref_apply, full = functp.functionalize(model)
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: _loss(forward(ref_apply, p, ids), tgt))(full)
    return (loss, apply.unshard(grads), fwd, log, specs, apply, params), (ref_loss, ref_grads)


def _named(model, patterns) -> set[str]:
    """The modules of ``model`` that fsdp_plan patterns (``*``: one name) name."""
    return {n for n, _ in model.named_modules() for p in patterns if _named_by(n, p)}


def _named_by(name, pattern) -> bool:
    return len(pattern.split(".")) == len(name.split(".")) and all(
        fnmatch.fnmatchcase(a, b) for a, b in zip(name.split("."), pattern.split(".")))
