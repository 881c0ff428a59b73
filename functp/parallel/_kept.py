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

import functools
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..mapping._state_dict import reading
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import under_fake_mode
from ._kept_tensors import NoGrad, Released, no_grad_of, released_like

__all__ = ["guard_kept", "arm", "structure", "changed_error"]

_KEPT = "_functp_kept"   # a kept parameter's mark: (module class, its name, weakref to apply)
_HOOKED = "_functp_hooked"   # its NoGrad-removing hook is registered
_ZEROED = "the kept module's gradients were set to None"   # Structure.changed()'s note
_registered = False


def guard_kept(apply, blocks: dict, specs: dict) -> tuple:
    """Marks the parameters of ``apply.module`` (kept copies or released meta
    tensors) so that an optimizer stepping them raises, registers that hook once, and
    makes ``module.state_dict()`` refuse once ``blocks`` were trained in place (or
    the module was released): it would hold the weights parallelize copied. Each
    kept parameter's ``.grad`` is a :class:`NoGrad` (a clip over them raises), and a
    released embedding or LM head weight a :class:`Released` meta tensor.
    **Returns:** ``(apply, blocks, specs)``, as given."""
    global _registered
    module = apply.module
    kind = type(module).__name__
    ref = weakref.ref(apply)
    _release_vocab(module, kind)
    for name, p in module.named_parameters(remove_duplicate=False):
        p.__dict__[_KEPT] = (kind, name, ref)
    arm(module)
    if apply._structure is not None:
        apply._structure.watch(module)
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


def arm(module) -> None:
    """A :class:`NoGrad` as the ``.grad`` of each of ``module``'s parameters, and,
    once per parameter, a hook that takes it away when a backward through the
    module itself (a reference run) brings a real gradient."""
    if under_fake_mode():
        return          # functp.estimate's trace: no script line runs on its module
    kind = type(module).__name__
    for name, p in module.named_parameters():
        p.grad = no_grad_of(p, kind, name)
        if p.requires_grad and not p.__dict__.get(_HOOKED):
            p.register_hook(functools.partial(_real_grad, weakref.ref(p)))
            p.__dict__[_HOOKED] = True


def _real_grad(ref, grad):
    # (before the gradient accumulates: AccumulateGrad then finds no .grad, sets this)
    p = ref()
    if p is not None and type(p.grad) is NoGrad:
        p.grad = None


def _release_vocab(module, kind: str) -> None:
    """A released (meta) embedding or LM head weight of a transformers model becomes
    a :class:`Released` one: its resize then names functp.resize_token_embeddings."""
    if not hasattr(module, "get_input_embeddings"):
        return
    if under_fake_mode():
        return          # functp.estimate's trace: no script line runs on its module
    names = {id(p): n for n, p in module.named_parameters()}
    for emb in _vocab_modules(module):
        p = emb._parameters.get("weight")
        if p is None or not p.is_meta or isinstance(p, Released):
            continue
        new = nn.Parameter(released_like(p, kind, names.get(id(p), "weight")),
                           requires_grad=p.requires_grad)
        for mod in module.modules():
            for short, q in list(mod._parameters.items()):
                if q is p:
                    mod._parameters[short] = new


def _vocab_modules(module) -> list:
    """The input embedding and the output embedding (LM head) modules, if any."""
    mods = [module.get_input_embeddings()]
    try:
        mods.append(module.get_output_embeddings())
    except (AttributeError, NotImplementedError):
        pass
    return [m for m in mods if m is not None]


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
    """What the blocks were laid out for, checked at each call of ``apply`` with few
    Python calls: a transformers model's config sizes (read from the config's own
    dict: its attribute access is a Python call) and the places of its embedding
    modules (``resize_token_embeddings`` swaps them in their parents' dicts); for
    every module, that its kept parameters' :class:`NoGrad` gradients are still there
    (``model.zero_grad()`` sets them to None: it zeroed nothing the step uses)."""

    _SIZES = ("vocab_size", "hidden_size", "num_hidden_layers")

    def __init__(self, module) -> None:
        self.module = module
        hf = getattr(module, "config", None) is not None and hasattr(module, "get_input_embeddings")
        self.config = vars(module.config) if hf else {}
        self.sizes = tuple(self.config.get(f) for f in self._SIZES) if hf else ()
        self.places = [(parent._modules, name, emb) for emb in (_vocab_modules(module) if hf else ())
                       for parent in module.modules()
                       for name, child in parent._modules.items() if child is emb]
        # a kept parameter whose .grad is a NoGrad, by weak reference (the module
        # holds it; torch.compile's search for a step's constants need not meet it)
        self.watched = None

    def watch(self, module) -> None:
        p = None if under_fake_mode() else next(
            (p for p in module.parameters() if not isinstance(p, Released)), None)
        self.watched = None if p is None else weakref.ref(p)

    def changed(self) -> str | None:
        """What changed since, in words (None: nothing)."""
        config = self.config
        for f, was in zip(self._SIZES, self.sizes):
            if config.get(f) != was:
                return f"config.{f} {was} -> {config.get(f)}"
        for d, name, emb in self.places:
            if d.get(name) is not emb:
                return f"its embedding module {name!r} was replaced"
        watched = self.watched() if self.watched is not None else None
        if watched is not None and watched.grad is None:
            return _ZEROED
        return None


def structure(module) -> Structure:
    """``module``'s :class:`Structure`."""
    return Structure(module)


def changed_error(module, what: str) -> ShardingError:
    kind = type(module).__name__
    if what == _ZEROED:
        arm(module)             # (armed again: one error per such line)
        return _zeroed_error(kind)
    return ShardingError(
        f"apply of parallelize({kind}): the module changed after parallelize ({what}: "
        f"model.resize_token_embeddings, a swapped submodule or an edited config); the "
        f"blocks and their specs are the old module's, so this call would mix the two. "
        f"A grown vocabulary: `apply, params, specs = functp.resize_token_embeddings("
        f"apply, params, new_num_tokens)` on every rank, in place of "
        f"model.resize_token_embeddings (transformers' own resize of the blocks' whole "
        f"embedding and LM head, laid out again; then build the optimizer); other "
        f"changes: change the module first, then parallelize it; save_pretrained only a "
        f"module whose config matches its blocks")


def _zeroed_error(kind: str) -> ShardingError:
    return ShardingError(
        f"apply of parallelize({kind}): {_ZEROED} since the last call "
        f"(model.zero_grad(), or optimizer.zero_grad() of an optimizer over "
        f"model.parameters()): they hold no gradients (apply trains the blocks), so it "
        f"zeroed nothing and the blocks' gradients would keep accumulating. Zero the "
        f"blocks' gradients with the optimizer over them, "
        f"`optimizer = torch.optim.AdamW(params.values(), ...)`, `optimizer.zero_grad()` "
        f"(or p.grad = None for each block), and remove model.zero_grad(); a "
        f"reference run of the unsharded module itself gets its own copy "
        f"(copy.deepcopy(model) before parallelize). docs/porting.md shows the loop")
