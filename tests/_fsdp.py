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


def _groups(model, specs, units=(), axis="fsdp") -> dict[str, str]:
    """The FSDP gather groups of the default rule, written out: each module owning a
    parameter split over ``axis`` -> the deepest module holding it that is an item of
    an ``nn.ModuleList`` or named in ``units``, else the root ("")."""
    lists = {f"{n}.{c}" if n else c for n, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) for c, _ in m.named_children()}
    canon, out = {id(p): n for n, p in model.named_parameters()}, {}     # (tied: once)
    for name, mod in model.named_modules():
        if any(axis in specs[canon[id(p)]].axes for p in mod.parameters(recurse=False)):
            parts = name.split(".") if name else []
            holders = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
            out[name] = next((h for h in holders if h in lists or h in units), "")
    return out


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
    return {n for n, _ in model.named_modules() for p in patterns
            if len(p.split(".")) == len(n.split(".")) and
            all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), p.split(".")))}
