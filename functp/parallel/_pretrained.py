"""``from_pretrained``: a transformers checkpoint folder straight into this rank's blocks.

The model is built on the meta device from ``config.json`` (no memory, no
initialization), :func:`functp.parallelize` lays it out, and each rank reads its
blocks from the safetensors files (``io/_safetensors.py``): only the bytes of its own
block, a packed weight's slice of each of its pieces, a tied weight once, converted
to the model's dtype on the way. The module keeps meta parameters: ``apply`` and the
returned blocks are the model. Buffers (rotary tables, embedding scales) are rebuilt
as transformers rebuilds them when it loads, by the model's own ``_init_weights``.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any

import torch
from torch import nn

from ..io._safetensors import INDEX, SINGLE, Folder, merges, read_block, require_hf, source_of
from ..mapping._sharding import unshard
from ..mesh._layout import block_ranges, unview, view, view_spec
from ..mesh._mesh import Mesh
from ..mesh._spec import P
from ..runtime import _world
from ..runtime._errors import CheckpointError, ShardingError, first_line
from ._parallelize import parallelize
from ._plans import Parallelized
from ._pp import PipelineStages, _stage_mesh
from ._style import Style

__all__ = ["from_pretrained", "init_blocks", "save_pretrained"]

_WHAT = "functp.from_pretrained"


def from_pretrained(path: str | os.PathLike, mesh: Mesh | None = None, plan: Any = "auto", *,
                    dtype: torch.dtype | None = None, distributed_config: Any = None,
                    trust_remote_code: bool = False, axis: str = "tp", **model_kwargs: Any
                    ) -> tuple[Parallelized, dict[str, torch.Tensor], dict[str, P]]:
    """Loads a transformers causal LM checkpoint folder as this rank's blocks.

    **Arguments:** ``path`` – a folder written by transformers' ``save_pretrained``
    (``config.json`` and ``model.safetensors``, or shards with
    ``model.safetensors.index.json``); ``mesh``, ``plan``, ``axis``,
    ``distributed_config`` – as :func:`functp.parallelize`; ``dtype`` – the
    parameters' dtype (default: ``config.json``'s ``dtype``, else float32);
    ``trust_remote_code`` – a ``config.json`` whose ``auto_map`` names code of its
    own is refused unless this is True (safetensors never run code; that code would);
    ``**model_kwargs`` – passed to transformers' ``from_config``
    (``attn_implementation="eager"``, ``experts_implementation="eager"``).

    **Returns:** ``(apply, params, specs)`` as :func:`functp.parallelize` (on a mesh
    with a ``pp`` axis: this rank's pipeline stage, whose decoder layers, and the
    embedding or the norm and head where it holds them, are all it reads); the model
    (``apply.module``) holds meta parameters only: the blocks are the weights, and
    calling the module itself raises; ``apply.module.generation_config`` is the
    folder's ``generation_config.json`` where it has one, as in transformers. The
    blocks are plain tensors, as ``parallelize``'s (``requires_grad`` False): enough
    for ``torch.func.grad``; for a tape step (``loss.backward()``) or a
    ``torch.optim`` optimizer first make them require grad:
    ``params = {k: v.requires_grad_() for k, v in params.items()}``.
    **Raises:** :class:`CheckpointError` on every rank for a missing tensor, a shape
    that does not match ``config.json``, a dtype that does not convert, a damaged or
    truncated file, or a folder of pickles (``pytorch_model.bin``: convert it to
    safetensors first).

    Example (``torchrun --nproc-per-node 2``)::

        mesh = functp.make_mesh((2,), ("tp",))
        apply, params, specs = functp.from_pretrained("my-llama", mesh)
        params["model.layers.0.self_attn.q_proj.weight"].shape   # half the rows
    """
    require_hf(_WHAT)
    config = _config(path, trust_remote_code)
    model = _meta_model(config, dtype, trust_remote_code, model_kwargs)
    _generation_config(path, model)
    apply, _, specs = parallelize(model, mesh, plan, axis=axis,
                                  distributed_config=distributed_config)
    device = _device(apply.mesh)
    if isinstance(apply, PipelineStages):       # this rank's stage(s) only
        params = _agreed(apply.mesh, lambda: _load_stages(Folder(path, _WHAT), apply, device))
        for module in apply.modules:
            rebuild_buffers(module, device)
    else:
        params = _agreed(apply.mesh, lambda: _load(Folder(path, _WHAT), apply, device))
    rebuild_buffers(model, device)
    for a in apply.chunks if isinstance(apply, PipelineStages) else [apply]:
        if isinstance(a, Parallelized):
            a.released = True
    return apply, params, specs


def _config(path: str | os.PathLike, trust_remote_code: bool):
    """``config.json``, refused when it asks for remote code the caller did not allow."""
    from transformers import AutoConfig
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{_WHAT}: cannot read {file}: {e}") from None
    if raw.get("auto_map") and not trust_remote_code:
        raise CheckpointError(
            f"{_WHAT}: {file} has an auto_map {raw['auto_map']} naming code of its own, "
            f"which loading it would run; read that code, then pass trust_remote_code=True")
    return AutoConfig.from_pretrained(os.fspath(path), trust_remote_code=trust_remote_code)


def _meta_model(config: Any, dtype: torch.dtype | None, trust_remote_code: bool,
                kwargs: dict) -> nn.Module:
    from transformers import AutoModelForCausalLM
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                trust_remote_code=trust_remote_code, **kwargs)


def _generation_config(path: str | os.PathLike, model: nn.Module) -> None:
    """The folder's ``generation_config.json`` as the model's, as transformers'
    ``from_pretrained`` sets it (``from_config`` made one from ``config.json`` only),
    so that :func:`save_pretrained` can write it back."""
    from transformers import GenerationConfig
    file = os.path.join(os.fspath(path), "generation_config.json")
    if not (os.path.isfile(file) and getattr(model, "can_generate", lambda: False)()):
        return
    try:
        model.generation_config = GenerationConfig.from_pretrained(os.fspath(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{_WHAT}: cannot read {file}: {e}") from None


def _device(mesh: Mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's canonical name -> all its names (a tied weight has several)."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(first.setdefault(id(p), n), []).append(n)
    return out


def _load(folder: Folder, apply: Parallelized, device: torch.device) -> dict[str, torch.Tensor]:
    """Every parameter's block, read from ``folder``; all sources checked first, so a
    bad checkpoint fails before any tensor is read."""
    model = apply.module
    return _read(folder, apply, *_sources(folder, model, *_names(model)), device)


def _load_stages(folder: Folder, stages: PipelineStages, device: torch.device):
    """The blocks of this rank's pipeline stage(s), a dict per chunk: only their own
    decoder layers (and the embedding, the norm and head where the stage holds them)
    are read, so a rank holds about 1/pp of the model. Every chunk's sources are
    checked before any tensor is read; they are found under any of their names in
    the whole model (a tied head under the embedding's)."""
    names = _names(stages.model)
    found = [_sources(folder, module, *names) for module in stages.modules]
    out = [_read(folder, chunk if isinstance(chunk, Parallelized) else None, full, sources,
                 device) for chunk, (full, sources) in zip(stages.chunks, found)]
    if stages.fsdp_dims is not None:     # (read as the plan's blocks, then cut over fsdp)
        from ._pp_fsdp import cut
        out = cut(stages, out)
    return out if stages.virtual_stages > 1 else out[0]


def _names(model: nn.Module) -> tuple[list, dict[str, list[str]]]:
    """``model``'s weight conversions and, for each parameter name, all its names."""
    conversions, _ = merges(model)
    return conversions, {n: names for names in _aliases(model).values() for n in names}


def _sources(folder: Folder, mine: nn.Module, conversions: list, tied: dict
             ) -> tuple[dict, dict]:
    """``mine``'s parameters and each one's checked source in ``folder`` (once per
    tied group), found under any of its names (``tied``: :func:`_names`)."""
    full = dict(mine.named_parameters())
    return full, {n: source_of(folder, tied.get(n, [n]), full[n].shape,
                               full[n].is_floating_point(), conversions) for n in _aliases(mine)}


def _read(folder: Folder, apply: Parallelized | None, full: dict, sources: dict,
          device: torch.device) -> dict[str, torch.Tensor]:
    """The blocks of ``sources`` as ``apply`` lays them out (None: whole tensors)."""
    out = {}
    for name, src in sources.items():
        p = full[name]
        if apply is None:
            out[name] = read_block(folder, src, [[(0, n)] for n in p.shape], p.dtype).to(device)
            continue
        style = apply._style(name)
        if type(style).shard_param is Style.shard_param:
            block = read_block(folder, src, block_ranges(p.shape, apply.specs[name],
                                                         apply.mesh, name), p.dtype)
        else:      # a style with its own block rule: read the leaf whole, once
            whole = read_block(folder, src, [[(0, n)] for n in p.shape], p.dtype)
            block = style.shard_param(name, whole, apply.specs[name], apply.mesh,
                                      apply.axes.get(name, apply.axis))
        out[name] = block.to(device)
    return out


def _agreed(mesh: Mesh, fn, what: str = _WHAT):
    """``fn()`` on every rank; an error on any rank raised on every rank (its own
    where it has one, else one naming the first failed rank)."""
    err, out = None, None
    try:
        out = fn()
    except Exception as e:      # noqa: BLE001 - an OSError mid-read as well
        err = e if isinstance(e, ShardingError) else CheckpointError(f"{what}: {e}")
        if err is not e:
            err.__cause__ = e
    lines = [b.decode() for b in _world.all_gather_bytes(
        b"" if err is None else first_line(err).encode() or b"?")]
    failed = [r for r, s in enumerate(lines) if s]
    if not failed:
        return out
    if err is not None:
        raise err
    raise CheckpointError(f"{what}: rank {failed[0]} failed: {lines[failed[0]]}")


def rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    """Gives every meta buffer of ``model`` its value, as transformers does after it
    loads a model built on the meta device: an empty tensor filled by the owning
    model's ``_init_weights`` (rotary tables, embedding scales). A buffer of a module
    with no such initializer is an error naming it."""
    owners = _init_owners(model)
    for mname, mod in model.named_modules():
        metas = [(n, b) for n, b in mod.named_buffers(recurse=False) if b.is_meta]
        if not metas:
            continue
        owner = owners.get(mname)
        if owner is None:
            raise ShardingError(
                f"module {mname!r} ({type(mod).__name__}) has buffers {[n for n, _ in metas]} "
                f"on the meta device and no transformers _init_weights to rebuild them; "
                f"build the model's buffers on a real device")
        for n, b in metas:
            mod._buffers[n] = torch.empty_like(b, device=device)
        owner._init_weights(mod)


def _init_owners(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> the nearest enclosing module with ``_init_weights``
    (transformers' PreTrainedModel: composite models have several)."""
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        parent = name.rpartition(".")[0] if "." in name else ("" if name else None)
        owner = mod if callable(getattr(mod, "_init_weights", None)) else out.get(parent)
        if owner is not None:
            out[name] = owner
    return out


def init_blocks(apply: Parallelized, *, seed: int = 0, device: torch.device | str | None = None
                ) -> dict[str, torch.Tensor]:
    """This rank's blocks of a freshly initialized model, whatever the mesh.

    For a model :func:`functp.parallelize` laid out on the meta device: one module at a
    time, its own parameters are materialized whole, initialized by the model's own
    initializer (transformers' ``_init_weights``, else the module's
    ``reset_parameters``) under a seed made of ``seed`` and the module's name, and
    cut to this rank's blocks; the full tensors are dropped before the next module.
    So every mesh starts from the same full parameters, bit for bit, and no rank ever
    holds more than one module's full weights. Meta buffers are rebuilt as
    :func:`functp.from_pretrained` rebuilds them.

    **Arguments:** ``apply`` – from ``parallelize`` of a meta-device model; ``seed``;
    ``device`` – where the blocks go (default: the mesh's device).
    **Returns:** the blocks, keyed as ``parallelize``'s. Example::

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        apply, _, specs = functp.parallelize(model, mesh, "auto")
        params = functp.init_blocks(apply, seed=0)
    """
    model = apply.module
    device = torch.device(device) if device is not None else _device(apply.mesh)
    owners = _init_owners(model)
    canon = {id(p): n for n, p in model.named_parameters()}
    blocks: dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        prefix = mname + "." if mname else ""
        own = {s: p for s, p in mod._parameters.items()
               if p is not None and canon.get(id(p)) == prefix + s}
        if own:
            blocks.update(_init_module(apply, mname, mod, own, owners.get(mname), seed, device))
    rebuild_buffers(model, device)
    apply.released = True
    return blocks


def _init_module(apply: Parallelized, mname: str, mod: nn.Module, own: dict, owner: Any,
                 seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The blocks of ``mod``'s own parameters, initialized whole (on the CPU) and cut."""
    if owner is None and not callable(getattr(mod, "reset_parameters", None)):
        raise ShardingError(
            f"init_blocks: module {mname!r} ({type(mod).__name__}) owns parameters "
            f"{sorted(own)} but has no initializer (transformers' _init_weights or a "
            f"reset_parameters method); give it one, or load weights with from_pretrained")
    prefix = mname + "." if mname else ""
    saved = dict(own)
    for s, p in own.items():
        mod._parameters[s] = nn.Parameter(torch.empty_like(p, device="cpu"),
                                          requires_grad=p.requires_grad)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(mname.encode()))
            owner._init_weights(mod) if owner is not None else mod.reset_parameters()
        return {prefix + s: apply.shard({prefix + s: mod._parameters[s].detach()})[prefix + s]
                .to(device) for s in own}
    finally:
        mod._parameters.update(saved)      # back to meta: the full tensors go


def save_pretrained(path: str | os.PathLike, params: dict[str, torch.Tensor],
                    specs: dict[str, P], mesh: Mesh, config: Any, *,
                    generation_config: Any = None) -> None:
    """Writes blocks as a folder transformers' ``from_pretrained`` loads on one process.

    Call it on every rank. Each parameter is gathered whole, one at a time, and kept
    only by the rank that writes it: the ranks share the parameters out by size and
    each writes one ``model-0000r-of-0000n.safetensors`` (no rank holds more than its
    share plus one parameter); rank 0 writes ``model.safetensors.index.json``,
    ``config.json`` and ``generation_config.json``. Packed weights are written in the
    model's own order (``[gate; up]``), tied weights once, under ``params``' names.

    The folder keeps no weight file of another model, and a save that stops midway
    leaves one that loads the new model or fails to load, never the old model or a
    mix: rank 0 first removes the files a loader would prefer (the index,
    ``model.safetensors``, ``pytorch_model.bin`` and its index) and writes the
    configs; each file is written under a temporary name and renamed, the index last;
    then the shards it does not name go (``*-0000k-of-0000n``, as transformers'
    ``save_pretrained`` removes them).

    **Arguments:** ``path`` – the folder (made if missing); ``params``, ``specs`` –
    this rank's blocks and their specs (from :func:`functp.parallelize` or
    :func:`functp.from_pretrained`); ``mesh``; ``config`` – the model's transformers
    config (``apply.module.config``); ``generation_config`` – written as
    ``generation_config.json`` (pass ``apply.module.generation_config`` to keep the
    one ``from_pretrained`` read); None: what transformers writes for a fresh model,
    ``GenerationConfig.from_model_config(config)`` when the model can generate (the
    class ``config.architectures[0]`` names, else the config's causal LM class, as
    ``from_pretrained`` builds), no file when it cannot.
    **Raises:** :class:`CheckpointError` on every rank when any rank fails to write.
    Example::

        functp.save_pretrained("out", params, specs, mesh, apply.module.config)
        model = transformers.AutoModelForCausalLM.from_pretrained("out")   # one process
    """
    what = "functp.save_pretrained"
    require_hf(what)
    from safetensors.torch import save_file
    path = os.fspath(path)
    names = sorted(params)
    if generation_config is None and _generates(config):
        from transformers import GenerationConfig
        generation_config = GenerationConfig.from_model_config(config)
    writer, files = _writers(params, specs, mesh, _tied_heads(config))
    me = _world.process_index()
    mine = {}
    # every rank of a stage (all ranks, without a pipeline), in one order: one gather
    # per parameter, over the stage's own mesh (its ranks hold the same parameters)
    piped = "pp" in mesh.axis_names and mesh.axis_size("pp") > 1
    stage = _stage_mesh(mesh) if piped else mesh
    for name in (n for n in names if n in writer):
        spec, x = specs[name], params[name].detach()
        full = x if stage is None else unview(unshard(view(x, spec), stage, view_spec(spec)),
                                              spec)
        if writer[name] == me:
            mine[name] = full.cpu().contiguous()
        del full

    def write():
        os.makedirs(path, exist_ok=True)
        if mine:
            _replace(os.path.join(path, files[me]),
                     lambda tmp: save_file(mine, tmp, metadata={"format": "pt"}))
    # the old model's preferred files go before any new weight is written, then every
    # file is written, then the index: each step on every rank before the next
    _agreed(mesh, lambda: me == 0 and _clear(path, config, generation_config), what)
    _agreed(mesh, write, what)
    _agreed(mesh, lambda: me == 0 and _commit(path, writer, files), what)


# what a loader reads in place of an index or shards: a folder holding one of these
# loads it (transformers prefers model.safetensors; functp the index; transformers
# falls back to the pickles), so they go before a save writes anything
_PREFERRED = (INDEX, SINGLE, "pytorch_model.bin", "pytorch_model.bin.index.json")
# transformers' rule for the stale shards of a previous save: a weights file name
# (``model``..., or ``pytorch_model``... for pickles) ending ``-0000k-of-0000n``; and a
# temporary file of a save that stopped
_SHARD = re.compile(r"(pytorch_)?model.*-\d{5}-of-\d{5}\.(safetensors|bin)")
_TMP = ".functp-tmp"


def _model_class(config: Any) -> Any:
    """The class ``from_pretrained`` builds for ``config``: ``architectures[0]``'s,
    else its causal LM class; None if neither."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        try:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except (KeyError, ValueError):
            return None
    return cls


def _generates(config: Any) -> bool:
    """Whether the model of ``config`` can generate (transformers then saves its
    generation config)."""
    return bool(getattr(_model_class(config), "can_generate", lambda: False)())


def _replace(final: str, write) -> None:
    """``write(tmp)`` then ``tmp`` renamed to ``final``: a reader sees the old file or
    the whole new one, never a part (a crash leaves only the temporary name)."""
    tmp = final + _TMP
    try:
        write(tmp)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _clear(path: str, config: Any, generation_config: Any) -> None:
    """(rank 0, before any weight) the old model's preferred files removed; the configs
    written now, so that the weights, written next, never meet an old config."""
    os.makedirs(path, exist_ok=True)
    for name in _PREFERRED:
        if os.path.isfile(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    config.save_pretrained(path)
    if generation_config is not None:
        generation_config.save_pretrained(path)


def _commit(path: str, writer: dict, files: dict) -> None:
    """(rank 0, every file written) the index, atomically; then the shards and
    temporary files of other saves, which no index names any more."""
    if len(files) > 1:
        total = sum(int(os.path.getsize(os.path.join(path, f))) for f in files.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: files[writer[k]] for k in sorted(writer)}}

        def dump(tmp):
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2)
        _replace(os.path.join(path, INDEX), dump)
    ours = set(files.values())
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if (name not in ours and os.path.isfile(full)
                and (_SHARD.fullmatch(name) or name.endswith(_TMP))):
            os.remove(full)


def _writers(params: dict, specs: dict, mesh: Mesh, tied: dict
             ) -> tuple[dict[str, int], dict[int, str]]:
    """Which rank writes each parameter of every rank's ``params`` (largest first, to
    the rank holding it with the fewest bytes so far; a pipeline's stages each hold
    their own) and each writing rank's file name: the same on every rank, from one
    gather of every rank's names and sizes. A tied head (``tied``: head -> embedding)
    is left to the embedding where a rank holds that: the weight is written once."""
    size = {k: v.numel() * mesh.axis_size(specs[k].axes) * v.element_size()
            if specs[k].axes else v.numel() * v.element_size() for k, v in params.items()}
    every = [json.loads(b) for b in _world.all_gather_bytes(json.dumps(size).encode())]
    holders: dict[str, list[int]] = {}
    for r, sizes in enumerate(every):
        for k, n in sizes.items():
            holders.setdefault(k, []).append(r)
            size[k] = n
    load, writer = [0] * len(every), {}
    for k in sorted(holders, key=lambda k: (-size[k], k)):
        if tied.get(k) in holders:
            continue
        r = min(holders[k], key=lambda r: (load[r], r))
        writer[k], load[r] = r, load[r] + size[k]
    used = sorted(set(writer.values()))
    if len(used) == 1:
        return writer, {used[0]: SINGLE}
    return writer, {r: f"model-{i + 1:05d}-of-{len(used):05d}.safetensors"
                    for i, r in enumerate(used)}


def _tied_heads(config: Any) -> dict[str, str]:
    """``{head: embedding}`` of the weights ``config``'s model ties (none when it does
    not tie them): a pipeline's last stage holds the head as its own copy."""
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    keys = getattr(_model_class(config), "_tied_weights_keys", None)
    return dict(keys) if isinstance(keys, dict) else {}
