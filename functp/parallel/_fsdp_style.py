"""The fully sharded (FSDP / ZeRO-3, and HSDP) parallel style.

Each parameter of the module is stored as this rank's block over the ``fsdp`` axis and
all-gathered when the module runs, in its forward pre-hook. The transpose of the
tiled ``all_gather`` is a reduce-scatter, so each rank's gradient comes back as the
gradient of its own block, summed over ``fsdp``. With ``replicate`` axes (HSDP's
``dp_replicate``) the block is first marked varying over them, so its gradient is also
all-reduced over them, on the block (1/fsdp of the weight), after the reduce-scatter,
as HSDP orders them.

**Prefetch.** A module's pre-hook also launches the gather of the next module's blocks,
kept until that module's pre-hook uses it (FSDP2's forward prefetch), in the plan's
module order checked on the first call: ``_fsdp_prefetch``.

**Free after forward** (transformers' ``free_full_weight``, FSDP2's
``reshard_after_forward=True``). Under tape autograd, a module that frees its weights
runs its forward under saved-tensor hooks: what autograd saves that is a view of a
gathered weight is kept as the block, and gathered again when the backward unpacks
it (in the same order on every rank), so the gathered weights go with the forward. A
group's freed weights are gathered again together, by one all-gather per dtype at the
backward's first unpack of any of them (FSDP2's pre-backward gather of a unit).
``torch.func``'s transforms take no saved-tensor hooks: under them the weights are
kept, as with ``keep_full_weight``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..ops import _context
from ..ops import _primitives as prim
from ..mesh._layout import uneven
from ..mesh._spec import P
from ..runtime import _compile
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import peek_interpreter_stack, top_saved_tensors_hooks
from ._fsdp_prefetch import Prefetch
from ._rules import matches_rule
from ._style import Style

__all__ = ["FullyShard"]


class _Regather:
    """The freed weights of one group in one ``apply`` call, gathered again in the
    backward all at once: one all-gather of one flat buffer per dtype at the first
    unpack of any of them (FSDP2 gathers a unit again in its pre-backward), the whole
    weights kept until each saved view of them has been unpacked."""

    def __init__(self, group) -> None:
        self.group = group
        self.blocks: dict[int, tuple] = {}      # id(block) -> (block, dim, full's layout)
        self.saved = 0                          # saved views packed (unpacks per backward)
        self.left = 0                           # of those, still to unpack in this backward
        self.fulls: dict[int, torch.Tensor] | None = None

    def add(self, block: torch.Tensor, dim: int, full: torch.Tensor) -> int:
        """A saved view of ``full`` (gathered from ``block`` on ``dim``) was freed."""
        self.saved += 1
        self.blocks.setdefault(id(block), (block.detach(), dim,
                                           (tuple(full.shape), full.stride())))
        return id(block)

    def full(self, key: int, name: str) -> torch.Tensor:
        """The whole weight of block ``key`` (of module ``name``), laid out as in the
        forward."""
        if torch.is_grad_enabled():
            raise ShardingError(
                f"FSDP module {name!r} frees its gathered weights after the forward "
                f"(free_full_weight), and this backward is itself differentiated "
                f"(create_graph=True), which needs the weights' own history; use "
                f"keep_full_weight for it, or differentiate with torch.func")
        if self.fulls is None:
            self.fulls, self.left = self._gather(), self.saved
        full, self.left = self.fulls[key], self.left - 1
        if self.left <= 0:
            self.fulls = None           # (each weight now lives as long as its views)
        return full

    def _gather(self) -> dict[int, torch.Tensor]:
        by_dtype: dict[tuple, list] = {}
        for key, (block, _, _) in self.blocks.items():
            by_dtype.setdefault((block.dtype, block.device), []).append(key)
        size, out = self.group.size, {}
        for keys in by_dtype.values():
            parts = [self.blocks[k][0].reshape(-1) for k in keys]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)      # copy-in
            gathered = prim.all_gather(flat, self.group, 0).view(size, -1)
            for key, piece in zip(keys, gathered.split([p.numel() for p in parts], dim=1)):
                block, dim, (shape, stride) = self.blocks[key]
                whole = list(block.shape)
                whole[dim] *= size
                full = piece.reshape(size, *block.shape).movedim(0, dim).reshape(whole)
                if full.stride() != stride:
                    # the saved views' geometry holds in the forward's layout (another
                    # gather of the group, or of part of it, may have laid it out so)
                    full = torch.empty_strided(shape, stride, dtype=full.dtype,
                                               device=full.device).copy_(full)
                out[key] = full
        return out


class _Freed:
    """A saved tensor that was a view of a gathered weight, dropped after the forward:
    its group's :class:`_Regather`, its block's key there, and the view's geometry in
    the gathered weight."""

    __slots__ = ("regather", "key", "name", "size", "stride", "offset")

    def __init__(self, regather: _Regather, key: int, name: str, view, full):
        self.regather, self.key, self.name = regather, key, name
        self.size, self.stride = tuple(view.shape), view.stride()
        self.offset = view.storage_offset() - full.storage_offset()

    def unpack(self) -> torch.Tensor:
        full = self.regather.full(self.key, self.name)
        return full.as_strided(self.size, self.stride, full.storage_offset() + self.offset)


class _FreeAfterForward:
    """Saved-tensor hooks for one call of a module: a tensor autograd saves that is a
    view of one of the module's gathered weights is kept as a :class:`_Freed` (the
    weight's memory goes once the forward is done) and gathered again on unpack, in
    the backward (which unpacks in the same order on every rank), with the rest of
    its group's freed weights (``regather``, shared by the group's calls)."""

    def __init__(self, regather: _Regather, name: str) -> None:
        self.regather, self.name = regather, name
        self.fulls: list = []                   # (gathered weight, its block, its dim)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        # (functp.estimate's fake tensors too: their storages have no address, but
        # each is its own storage object, as a real one)
        if type(t) in _PLAIN and t.layout == torch.strided:
            storage = _storage(t)
            for full, block, dim in self.fulls:
                # a view of this weight: its storage, and its first element within it
                # (a storage shared by several weights would need the element range)
                if (storage == _storage(full)
                        and 0 <= t.storage_offset() - full.storage_offset() < full.numel()):
                    return _Freed(self.regather, self.regather.add(block, dim, full),
                                  self.name, t, full)
        return t

    @staticmethod
    def unpack(x):
        return x.unpack() if type(x) is _Freed else x


_PLAIN = (torch.Tensor, FakeTensor)


def _storage(t: torch.Tensor) -> int:
    """Which storage ``t`` is a view of (the same for every view of one storage)."""
    return t.untyped_storage()._cdata


_HOW = ("free_full_weight", "keep_full_weight")     # transformers' fsdp_plan styles


def _frees(plan, name: str) -> bool:
    """Whether module ``name`` frees its gathered weights under ``plan``: a bool, or
    transformers' ``fsdp_plan`` ({module pattern: "free_full_weight" or
    "keep_full_weight"}, ``*`` standing for one name, the deepest match among the
    module and its parents deciding)."""
    if not isinstance(plan, dict):
        return bool(plan)
    parts = name.split(".") if name else []
    for k in range(len(parts), -1, -1):
        prefix = ".".join(parts[:k])
        for pattern, how in plan.items():
            if matches_rule(pattern, prefix):
                return how == "free_full_weight"
    return False


def _embeddings(root: nn.Module, names: dict) -> tuple[str | None, str | None]:
    """The names of ``root``'s input embedding and output head (transformers'
    ``get_input_embeddings`` / ``get_output_embeddings``), None where it has none."""
    out = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        try:
            m = getattr(root, get)() if hasattr(root, get) else None
        except (NotImplementedError, AttributeError):     # (a model without one)
            m = None
        out.append(None if m is None else names.get(id(m)))
    return out[0], out[1]


def _fsdp2_units(root: nn.Module, plan: dict) -> dict[str, str]:
    """The FSDP2 units transformers' ``fsdp_plan`` makes of ``root``: module name ->
    the name of its unit's group.

    Each module a pattern of ``plan`` names is a unit (the first matching pattern
    says how), after transformers folds a tied LM head's rule into the embedding's
    (with ``all_tied_weights_keys``: the embedding's own rule dropped, and a
    ``keep_full_weight`` head's moved to it); where exactly two modules are kept
    (``keep_full_weight``) and they are the final norm (``norm`` or ``*.norm``) and
    the input embedding or the output head, the two are one unit, gathered together
    (``"model.norm+lm_head"``), as transformers wraps that tail pair in one
    ``fully_shard``. Example: a transformers Llama's plan (``model.embed_tokens``
    and ``model.layers.*`` freed, ``model.norm`` and ``lm_head`` kept) gives the
    embedding, each layer, and ``model.norm+lm_head``."""
    names = {id(m): n for n, m in root.named_modules()}
    how = {}
    for n in names.values():
        h = next((h for p, h in plan.items() if matches_rule(p, n)), None)
        if h is not None:
            how[n] = h
    embed, head = _embeddings(root, names)
    if getattr(root, "all_tied_weights_keys", None) and embed is not None and head is not None:
        how.pop(embed, None)
        if how.get(head) == "keep_full_weight":
            del how[head]
            how[embed] = "keep_full_weight"
    units = {n: n for n in how}
    kept = [n for n in names.values() if how.get(n) == "keep_full_weight"]
    if (len(kept) == 2 and any(n == "norm" or n.endswith(".norm") for n in kept)
            and any(n is not None and n in (embed, head) for n in kept)):
        units.update(dict.fromkeys(kept, "+".join(kept)))
    return units


def _module_groups(root: nn.Module, groups, free, mods: list) -> tuple[dict, dict]:
    """:meth:`FullyShard.plan_groups`' rule, for the modules ``mods`` of ``root``'s
    tree: returns (module name -> group name, id(module) -> group name)."""
    named = dict(root.named_modules())
    names = {id(m): n for n, m in named.items()}
    if groups == "module":
        units = {n: n for n in named}
    elif groups is not None:
        units = {n: n for n in named if any(matches_rule(p, n) for p in groups)}
    else:
        units = _fsdp2_units(root, free if isinstance(free, dict) else {})
        for n, m in named.items():
            if isinstance(m, nn.ModuleList):
                for c, _ in m.named_children():
                    units.setdefault(f"{n}.{c}" if n else c, f"{n}.{c}" if n else c)
    owner = {}                      # id(parameter) -> the first module holding it
    for n, m in named.items():
        for p in m._parameters.values():
            if p is not None:
                owner.setdefault(id(p), n)

    def unit(name: str) -> str:
        parts = name.split(".") if name else []
        return next((units[".".join(parts[:k])] for k in range(len(parts), 0, -1)
                     if ".".join(parts[:k]) in units), "")

    out, of_module = {}, {}
    for mod in mods:
        name = names.get(id(mod))
        if name is None:
            continue                # (another model's module: its own plan groups it)
        out[name] = unit(name)
        # a module whose weights are another's (an LM head tied to the embedding)
        # goes with that module's group, as FSDP2 wraps a parameter once
        tied = {owner[id(p)] for p in mod._parameters.values() if p is not None}
        if out[name] == "" and len(tied) == 1 and name not in tied:
            out[name] = unit(tied.pop())
        of_module[id(mod)] = out[name]
    return out, of_module


class FullyShard(Style):
    """Shards every own parameter of a module over the plan axis; gathers it per call,
    one module ahead (see prefetch below).

    **Arguments:** ``size`` – the size of the plan axis (a parameter is split on dim 0
    when ``size`` divides it, else on its first dimension it divides, else kept
    replicated: :meth:`reason` says why); ``replicate`` – mesh axes over which the
    shards are replicated (HSDP: ``("dp_replicate",)``), whose gradients are summed
    on the block; ``prefetch`` – True (the default): from the second call on, each
    module's pre-hook also gathers the next module's blocks (in the plan's module
    order, where the first call ran them in that order); False: each module gathers
    its own, in its pre-hook. The values and gradients are the same either way;
    ``free`` – True, or transformers' ``fsdp_plan`` (``{module pattern:
    "free_full_weight" or "keep_full_weight"}``, ``*`` one name, the deepest pattern
    matching the module or a parent deciding): under tape autograd such a module's
    gathered weights are freed after its forward and gathered again in the backward
    (1/size of their memory between the two, one more gather per group and dtype
    whose weights the backward reads; not with ``create_graph=True``). ``torch.func`` transforms keep them;
    ``groups`` – which modules' blocks are gathered together, by one all-gather per
    dtype (and their gradients reduce-scattered by one): None (the default) groups
    each module under the deepest unit holding it, the units being those
    transformers' FSDP2 wrapping makes of ``free``'s plan (each module it names; the
    final norm and the LM head, when both are kept, one unit) and each item of an
    ``nn.ModuleList`` (a layer), the rest in the root's group (a tied LM head in its
    embedding's); a list of module patterns names the units instead; ``"module"``:
    one group per module.
    A group is gathered when its first module runs (and prefetched whole).

    Example (what ``parallelize(model, mesh, {"fsdp": "auto"})`` applies to each module;
    ``{"fsdp": FullyShard(4, prefetch=False)}`` turns prefetch off,
    ``FullyShard(4, free=True)`` frees every module's weights after its forward)::

        style = FullyShard(4)
        style.param_specs(torch.nn.Linear(8, 6), "fsdp")    # weight P(None, 'fsdp'), bias P()
    """

    def __init__(self, size: int, replicate: tuple[str, ...] = (), prefetch: bool = True,
                 free: bool | dict = False, groups: str | list[str] | None = None):
        self.size, self.prefetch = size, bool(prefetch)
        if not (groups is None or groups == "module" or (
                isinstance(groups, (list, tuple)) and all(isinstance(g, str) for g in groups))):
            raise ShardingError(
                f"FullyShard: groups must be None (the default units), 'module' (one "
                f"gather per module) or a list of module patterns; got {groups!r}")
        self.groups = groups if groups is None or groups == "module" else list(groups)
        # (one axis may come as its name: tuple("dp_replicate") would be its letters)
        self.replicate = (replicate,) if isinstance(replicate, str) else tuple(replicate)
        if isinstance(free, dict):
            bad = {k: v for k, v in free.items() if v not in _HOW}
        else:
            bad = None if isinstance(free, bool) else free
        if bad:     # (a string is truthy: "keep_full_weight" would free everything)
            raise ShardingError(
                f"FullyShard: free must be a bool or transformers' fsdp_plan, a dict of "
                f"module patterns to {' or '.join(map(repr, _HOW))}; got {bad!r}")
        self.free = dict(free) if isinstance(free, dict) else free
        self._free_at: dict[str, bool] = {}            # module name -> frees its weights
        self._gathers = Prefetch(self.replicate, self.prefetch)

    def dim(self, shape: tuple[int, ...]) -> int | None:
        """The dimension a parameter of ``shape`` is split on, or None (replicated)."""
        return next((d for d, n in enumerate(shape) if not uneven(n, self.size)), None)

    def reason(self, shape: tuple[int, ...]) -> str:
        """Why a parameter of ``shape`` stays replicated over the plan axis."""
        return (f"no dimension of shape {tuple(shape)} divides into {self.size} fsdp "
                f"shards; pad one of them to a multiple of {self.size}")

    def param_specs(self, module: nn.Module, axis):
        specs, dims, shapes = {}, {}, {}
        for name, p in module.named_parameters(recurse=False):
            d = self.dim(tuple(p.shape))
            specs[name] = P() if d is None else P(*([None] * d), axis)
            if d is not None:
                dims[name] = d
                shapes[name] = tuple(n // self.size if i == d else n
                                     for i, n in enumerate(p.shape))
        self._gathers.register(module, dims, shapes)
        return specs

    def plan_groups(self, root: nn.Module) -> dict[str, str]:
        """Puts the modules this style shards (those of ``root``'s tree) in their
        gather groups; returns module name -> the name of its group (its unit's name;
        ``"a+b"`` for two units gathered as one; ``""``: the root's group).

        A unit is a module the ``groups`` patterns name, or by default what
        transformers' FSDP2 wrapping makes one (:func:`_fsdp2_units`: each module the
        ``free`` plan names, the final norm and the LM head kept together, and each
        item of an ``nn.ModuleList``, the repeated layers); a module belongs to the
        deepest unit holding it, else, where each of its parameters is another
        module's (tied), to that module's group, else to the root's (``""``), as
        FSDP2's root ``fully_shard`` takes what is left."""
        order = self._gathers.order
        out, of_module = _module_groups(root, self.groups, self.free, list(order.mods.values()))
        for key, group in of_module.items():
            order.key[key] = (id(root), group)
        order.rebuild()
        return out

    def prepare_input(self, module, args, kwargs, call):
        # the module sees each whole weight from here until its forward returns;
        # functional_call puts the caller's tensors back when apply ends
        dims = self._gathers.dims.get(id(module), {})
        if not dims:
            return args, kwargs
        eager = not _compile.tracing()     # (compiled: inductor orders the gathers)
        own = {s: (call.params[s], d) for s, d in dims.items() if call.params.get(s) is not None}
        gathers = self._gathers
        fulls = gathers.arrive(module, own, call) if eager else gathers.gather(own, call.axis)
        restore = call.state.setdefault("restore", {})
        free = self._freer(module, call) if eager else None
        for short, (block, d) in own.items():
            full = fulls[short]
            restore[short] = module._parameters[short]
            module._parameters[short] = full
            if free is not None and full.numel():
                free.fulls.append((full, block, d))
        if free is not None and free.fulls:
            free.hooks.__enter__()          # (left in prepare_output, or when apply ends)
            call.state["free"] = free
            call.on_exit(lambda: self._stop_freeing(call))
        return args, kwargs

    def _freer(self, module: nn.Module, call) -> _FreeAfterForward | None:
        """The saved-tensor hooks that free this call's gathered weights: where the plan
        says so and tape autograd records (torch.func's transforms take no saved-tensor
        hooks; inside other hooks, a checkpointed region, the region decides what is
        saved: there the weights are kept)."""
        frees = self._free_at.get(call.name)
        if frees is None:
            frees = self._free_at[call.name] = _frees(self.free, call.name)
        top = top_saved_tensors_hooks(False)      # (a freeing parent's are fine)
        if not (frees and torch.is_grad_enabled() and peek_interpreter_stack() is None
                and (top is None or type(getattr(top[0], "__self__", None))
                     is _FreeAfterForward)):
            return None
        # one regather per group and apply call, shared by the group's module calls
        regather = self._gathers.per_call(self._gathers.group_of(module), lambda: _Regather(
            _context.current("FullyShard").mesh.axis_group(call.axis)))
        return _FreeAfterForward(regather, call.name)

    @staticmethod
    def _stop_freeing(call) -> None:
        free = call.state.pop("free", None)
        if free is not None:
            free.hooks.__exit__(None, None, None)
            free.fulls.clear()          # (the weights go with the forward's last use)

    def prepare_output(self, module, args, kwargs, output, call):
        self._stop_freeing(call)
        for short, block in call.state.get("restore", {}).items():
            module._parameters[short] = block
        return output

    def __repr__(self) -> str:
        return (f"FullyShard(size={self.size}, replicate={self.replicate}"
                f"{'' if self.prefetch else ', prefetch=False'}"
                f"{'' if self.groups is None else f', groups={self.groups!r}'}"
                f"{f', free={self.free!r}' if self.free else ''})")
