"""The module ``parallelize`` keeps is not the model being trained: its parameters are
copies (or, with ``keep_module=False``, meta tensors) that ``apply`` never reads. A
ported DDP script's own ``torch.optim`` optimizer over ``model.parameters()`` would step
them and train nothing, silently; so an optimizer holding one of them refuses its
first ``step()``, naming what to build it over instead (the blocks).

DDP and FSDP2 users expect ``model.parameters()`` to be what trains. functp's blocks
are a separate pytree by design (a pure function over them), so the kept parameters
cannot be what trains; they stay usable for what they are (the unsharded reference:
``verify_plan``, a float64 check, sampling after ``load_state_dict`` of the trained
weights), and the one use that can only be a mistake, stepping them, is refused.

Likewise ``model.state_dict()`` (the script's checkpoint) once the blocks were
trained in place, or with the module released: it would save the initial weights (or
meta tensors); it names ``apply.state_dict(params)``. After
``model.load_state_dict(apply.state_dict(params))`` the module holds the trained
weights and its state dict is read as usual.

The optimizer check is torch's global optimizer step pre-hook (``torch.optim.optimizer.
register_optimizer_step_pre_hook``), registered once, at the first ``parallelize``:
each step of any optimizer then reads one dict entry per parameter.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..mapping._state_dict import reading
from ..runtime._errors import ShardingError

__all__ = ["guard_kept", "structure", "changed_error"]

_KEPT = "_functp_kept"   # a kept parameter's mark: (module class, its name, weakref to apply)
_registered = False


def guard_kept(apply, blocks: dict, specs: dict) -> tuple:
    """Marks the parameters of ``apply.module`` (kept copies or released meta
    tensors) so that an optimizer stepping them raises, registers that hook once, and
    makes ``module.state_dict()`` refuse once ``blocks`` were trained in place (or
    the module was released): it would hold the weights parallelize copied.
    **Returns:** ``(apply, blocks, specs)``, as given."""
    global _registered
    module = apply.module
    kind = type(module).__name__
    ref = weakref.ref(apply)
    for name, p in module.named_parameters(remove_duplicate=False):
        p.__dict__[_KEPT] = (kind, name, ref)
    if not _registered:
        register_optimizer_step_pre_hook(_refuse_kept)
        _registered = True
    if getattr(module, "_functp_guarded", None) is None:
        module.register_state_dict_pre_hook(_refuse_stale)
        module.register_load_state_dict_post_hook(_synced)
    # the blocks and their version counters (an optimizer's step, in place, bumps them)
    module._functp_guarded = (ref, [(weakref.ref(b), b._version) for b in blocks.values()
                                    if isinstance(b, torch.Tensor)])
    return apply, blocks, specs


def _trained(module) -> str | None:
    """Why ``module``'s own weights are not the trained ones, if they are not."""
    ref, versions = module._functp_guarded
    if ref() is None:
        return None
    if any(p.is_meta for p in module.parameters()):
        return "its split parameters were released (meta tensors: keep_module=False)"
    if any(b() is not None and b()._version != v for b, v in versions):
        return "the blocks were updated since parallelize copied them"
    return None


def _refuse_stale(module, prefix, keep_vars) -> None:
    if prefix or reading() or getattr(module, "_functp_guarded", None) is None:
        return
    why = _trained(module)
    if why is not None:
        raise ShardingError(
            f"{type(module).__name__}.state_dict(): {why}, so the module holds the "
            f"weights parallelize started from, not the trained ones. Call "
            f"`apply.state_dict(params)` (or functp.full_state_dict(params, mesh, specs, "
            f"module=model)) on every rank: every key of module.state_dict(), ready for "
            f"load_state_dict and torch.save on one rank; or "
            f"`model.load_state_dict(apply.state_dict(params))` first to bring the "
            f"trained weights into the module")


def _synced(module, incompatible) -> None:
    """After ``load_state_dict``: the module holds what was loaded (the trained
    weights, as a rule): its state dict is what the user asked for."""
    ref, versions = module._functp_guarded
    module._functp_guarded = (ref, [(b, b()._version) for b, _ in versions if b() is not None])


def _refuse_kept(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            mark = p.__dict__.get(_KEPT)
            if mark is not None and mark[2]() is not None:
                raise _kept_error(type(optimizer).__name__, *mark[:2], p.is_meta)


def _kept_error(opt: str, kind: str, name: str, meta: bool) -> ShardingError:
    what = ("a meta tensor (keep_module=False released it)" if meta else
            "the copy parallelize left in the module, which apply never reads")
    return ShardingError(
        f"{opt}.step(): its parameter {name!r} of the parallelized {kind} is {what}: "
        f"stepping it trains nothing. Build the optimizer over the blocks parallelize "
        f"returned, `apply, params, specs = functp.parallelize(model, ...)`: "
        f"`torch.optim.{opt}(params.values(), ...)` (blocks with .requires_grad_() for a "
        f"tape step, or gradients put on them with functp.set_grads), and clip their "
        f"gradients with functp.clip_by_global_norm(grads, max_norm, mesh, specs) "
        f"(clip_grad_norm_(model.parameters()) clips nothing either). For a "
        f"param-group split (no weight decay on norms), "
        f"group the blocks by the same names (params is keyed by the module's parameter "
        f"names). To train the unsharded module itself as a reference, give that run "
        f"its own copy (copy.deepcopy(model)). docs/porting.md shows the whole loop")


class Structure:
    """What a transformers model's blocks were laid out for, checked at each call of
    ``apply`` with no Python call: its config's sizes (read from the config's own
    dict: its attribute access is a Python call) and the places of its embedding
    modules (``resize_token_embeddings`` swaps them in their parents' dicts)."""

    _SIZES = ("vocab_size", "hidden_size", "num_hidden_layers")

    def __init__(self, module) -> None:
        self.module = module
        self.config = vars(module.config)
        self.sizes = tuple(self.config.get(f) for f in self._SIZES)
        embeddings = [module.get_input_embeddings()]
        try:
            embeddings.append(module.get_output_embeddings())
        except (AttributeError, NotImplementedError):
            pass
        self.places = [(parent._modules, name, emb) for emb in embeddings if emb is not None
                       for parent in module.modules()
                       for name, child in parent._modules.items() if child is emb]

    def changed(self) -> str | None:
        """What changed since, in words (None: nothing)."""
        config = self.config
        for f, was in zip(self._SIZES, self.sizes):
            if config.get(f) != was:
                return f"config.{f} {was} -> {config.get(f)}"
        for d, name, emb in self.places:
            if d.get(name) is not emb:
                return f"its embedding module {name!r} was replaced"
        return None


def structure(module) -> Structure | None:
    """A transformers model's :class:`Structure`; None for another module (nothing
    cheap to compare)."""
    if getattr(module, "config", None) is None or not hasattr(module, "get_input_embeddings"):
        return None
    return Structure(module)


def changed_error(module, what: str) -> ShardingError:
    kind = type(module).__name__
    return ShardingError(
        f"apply of parallelize({kind}): the module changed after parallelize ({what}: "
        f"model.resize_token_embeddings, a swapped submodule or an edited config); the "
        f"blocks and their specs are the old module's, so this call would mix the two. "
        f"Change the module first, then parallelize it (a grown vocabulary: "
        f"model.resize_token_embeddings(n, mean_resizing=False) on the unsharded model, "
        f"then functp.parallelize; after functp.from_pretrained, whose module holds no "
        f"weights, resize a transformers model loaded on one process, save_pretrained it "
        f"and load that folder), and save_pretrained only a module whose config matches "
        f"its blocks")
