"""``functp.from_pretrained``: a checkpoint folder written by transformers' own
``save_pretrained`` loads straight into each rank's blocks, and the loss and every
gradient equal those of the unsharded model transformers loads from the same folder
(float64). Bad checkpoints are a CheckpointError on every rank.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import functp
from functp import P
from _oracle import grads_and_loss

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=4, pad_token_id=0,
               bos_token_id=1, eos_token_id=2, max_position_embeddings=32)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "phi3": ("Phi3Config", {}),                                    # packed qkv and gate_up
    "gemma": ("GemmaConfig", {"tie_word_embeddings": True}),       # tied, embedding scale
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=8)),   # per-expert files
}
EAGER = dict(attn_implementation="eager", experts_implementation="eager")   # float64
# Gemma's RMSNorm computes in float32 whatever the parameters' dtype: once the batch is
# split (dp) its rounding differs from the unsharded model's at float32's 1e-7
TOL = {"gemma": 1e-6}


def _save(folder, kind: str, shard: bool = False) -> str:
    """A tiny random checkpoint written by transformers itself."""
    cls, extra = CONFIGS[kind]
    config = getattr(transformers, cls)(**{**_COMMON, **extra})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    path = os.path.join(str(folder), kind + ("-sharded" if shard else ""))
    model.save_pretrained(path, max_shard_size="8KB" if shard else "5GB")
    return path


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _reference(path, **kw):
    """A batch, its targets, and the gradients and loss of transformers' own
    from_pretrained model (float64, ``kw``: its attention) on them."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **kw)
    g = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(3, VOCAB, (4, 8), generator=g), torch.randint(VOCAB, (4, 8), generator=g)
    ref_apply, full = functp.functionalize(ref)
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: _loss(ref_apply(p, input_ids=ids, use_cache=False).logits, tgt))(full)
    return ids, tgt, ref_grads, ref_loss


def _worst(grads, loss, ref_grads, ref_loss) -> float:
    """The worst relative error of the loss and of each (unsharded) gradient."""
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    worst = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    for k, r in ref_grads.items():
        worst = max(worst, (grads[k] - r).abs().max().item() / max(r.abs().max().item(), 1e-12))
    return worst


def _compare(path, shape, names, tape, plan="auto"):
    """Worst relative error of the loss and of each gradient against transformers'
    own from_pretrained model, and the names of the parameters compared."""
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh(shape, names)
    apply, params, specs = functp.from_pretrained(path, mesh, plan, dtype=torch.float64, **EAGER)
    ids, tgt, ref_grads, ref_loss = _reference(path, **EAGER)
    batch = apply.batch_axes or None

    def local(p, i, t):
        loss = _loss(apply(p, input_ids=i, use_cache=False).logits, t)
        return functp.pmean(loss, batch) if batch else loss
    step = functp.shard_map(local, mesh, in_specs=(specs, P(batch), P(batch)), out_specs=P())
    grads, loss = grads_and_loss(step, params, *functp.shard((ids, tgt), mesh, P(batch)),
                                 tape=tape)
    return _worst(apply.unshard(grads), loss, ref_grads, ref_loss), sorted(specs)


_MESHES = {"tp2": ((2,), ("tp",)), "dp2_tp2": ((2, 2), ("dp", "tp")),
           "fsdp2": ((2,), ("fsdp",)), "ep2": ((2,), ("ep",))}
_CASES = [("llama", "tp2", False), ("llama", "dp2_tp2", True), ("llama", "fsdp2", False),
          ("phi3", "tp2", True), ("gemma", "dp2_tp2", False), ("qwen3_moe", "tp2", False),
          ("qwen3_moe", "fsdp2", True), ("qwen3_moe", "ep2", False)]


@pytest.mark.parametrize("kind,mesh_name,tape", _CASES,
                         ids=[f"{k}-{m}-{'tape' if t else 'grad'}" for k, m, t in _CASES])
def test_loads_blocks_whose_loss_and_gradients_equal_transformers_model(
        run, tmp_path, kind, mesh_name, tape):
    path = _save(tmp_path, kind)
    shape, names = _MESHES[mesh_name]
    out = run(len(names) * 2, _compare, path, shape, names, tape, gloo=True)
    worst, loaded = out[0]
    assert worst < TOL.get(kind, 1e-10), f"{kind} on {mesh_name}: differs by {worst:.2e}"
    assert len(loaded) > 5


# Phi-3's own plan gathers gate_up_proj's output (no packing needed): this plan splits it
# packed, so that each rank reads its slice of gate and of up from the fused tensor
PACKED = {"model.layers.*.mlp.gate_up_proj": "packed_colwise",
          "model.layers.*.mlp.down_proj": "rowwise"}


def test_a_packed_gate_up_weight_is_read_per_piece(run, tmp_path):
    worst, _ = run(2, _compare, _save(tmp_path, "phi3"), (2,), ("tp",), False, PACKED,
                   gloo=True)[0]
    assert worst < 1e-10, worst


def test_sharded_checkpoint_with_an_index_loads_the_same(run, tmp_path):
    path = _save(tmp_path, "qwen3_moe", shard=True)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) > 2 and os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    worst, _ = run(4, _compare, path, (2, 2), ("dp", "tp"), False, gloo=True)[0]
    assert worst < 1e-10, worst


def _staged(path, shape, names, schedule):
    """from_pretrained onto a mesh with a pp axis, then a pipelined step: the worst
    error against transformers' own model, the parameters this rank holds, and the
    checkpoint keys it read (``read_block`` counted)."""
    from unittest import mock
    from functp.parallel import _pretrained
    warnings.simplefilter("ignore")
    read = []

    def counted(folder, src, ranges, dtype):
        read.append(getattr(src, "key", repr(src)))
        return real(folder, src, ranges, dtype)
    real = _pretrained.read_block
    mesh = functp.make_mesh(shape, names)
    with mock.patch.object(_pretrained, "read_block", counted):
        apply, params, specs = functp.from_pretrained(path, mesh, dtype=torch.float64, **EAGER)
    ids, tgt, ref_grads, ref_loss = _reference(path, **EAGER)
    step = apply.pipeline(microbatches=2, loss_fn=_loss, schedule=schedule)
    loss, grads = step(params, ids, tgt)
    mine = apply.unshard(grads)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if apply.tied else {}
    ref = {k: ref_grads[tied.get(k, k)] for k in mine}      # this stage's parameters
    return _worst(mine, loss, ref, ref_loss), sorted(mine), sorted(set(read))


@pytest.mark.parametrize("kind,shape,names,schedule", [
    ("llama", (2,), ("pp",), "1f1b"), ("gemma", (2, 2), ("pp", "tp"), "zero_bubble"),
    ("llama", (2, 2), ("dp", "pp"), "gpipe"), ("gemma", (2, 2), ("fsdp", "pp"), "1f1b")])
def test_loads_onto_a_pipeline_reading_only_its_stage(run, tmp_path, kind, shape, names,
                                                       schedule):
    # two decoder layers, one a stage; gemma ties its embedding to its head: the last
    # stage reads the head from the embedding's stored tensor (beside fsdp: read as the
    # plan's blocks, then cut into this rank's block over fsdp)
    path = _save(tmp_path, kind)
    for rank, (worst, held, read) in enumerate(run(2 * len(shape), _staged, path, shape,
                                                   names, schedule, gloo=True)):
        stage = rank // 2 if names[0] == "pp" and len(shape) > 1 else rank % 2
        assert worst < TOL.get(kind, 1e-10), (kind, names, rank, worst)
        layers = {k.split(".")[2] for k in read if k.startswith("model.layers.")}
        assert layers == {str(stage)}, (rank, read)
        assert {k.split(".")[2] for k in held if k.startswith("model.layers.")} == {str(stage)}
        assert ("model.embed_tokens.weight" in read) == (stage == 0 or kind == "gemma"), read
        assert ("model.norm.weight" in read) == (stage == 1), (rank, read)


def _blocks(path):
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh((2,), ("tp",))
    apply, params, specs = functp.from_pretrained(path, mesh)
    try:
        apply.module(torch.zeros(1, 4, dtype=torch.long))
        called = "ran"
    except functp.ShardingError as e:
        called = str(e)
    held = {n: p.is_meta for n, p in apply.module.named_parameters()}
    # a block owns its bytes alone (safetensors' slices are views of the whole tensor)
    alone = all(v.untyped_storage().nbytes() == v.numel() * v.element_size()
                for v in params.values())
    return ({k: tuple(v.shape) for k, v in params.items()}, {k: repr(s) for k, s in specs.items()},
            called, held, alone)


def test_each_rank_holds_its_blocks_and_the_module_refuses_to_run(run, tmp_path):
    path = _save(tmp_path, "phi3")
    shapes, specs, called, held, alone = run(2, _blocks, path)[0]
    assert alone, "a block keeps a larger storage alive"
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (32, 16), shapes
    assert shapes["model.embed_tokens.weight"] == (32, 16), shapes
    assert all(held.values()), held          # the module itself holds no weights
    assert "weights were released" in called and "apply(params" in called, called


def test_block_ranges_cut_the_block_local_of_cuts():
    from functp.mesh._layout import block_ranges, local_of
    x = torch.arange(12 * 6).view(12, 6)
    for spec in (P("tp", None, packed={0: 2}), P(None, "tp"), P(("dp", "tp")),
                 P("dp", "tp", packed={0: 3})):
        for coord in ({"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}):
            mesh = _FakeMesh(coord)
            ranges = block_ranges(x.shape, spec, mesh)
            rows = [i for o, n in ranges[0] for i in range(o, o + n)]
            cols = [j for o, n in ranges[1] for j in range(o, o + n)]
            assert torch.equal(x[rows][:, cols], local_of(x, spec, mesh)), (spec, coord)


class _FakeMesh:
    """What the layout functions read of a mesh: a (2, 2) mesh at ``coord``."""
    def __init__(self, coord):
        self.shape, self.coordinate = {"dp": 2, "tp": 2}, coord

    def axis_size(self, axes):
        axes = (axes,) if isinstance(axes, str) else axes
        return 2 ** len(axes)


# -- bad checkpoints -------------------------------------------------------------------


def _damage(path, how: str) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    if how == "missing":
        del tensors["model.layers.1.mlp.down_proj.weight"]
    elif how == "shape":
        tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(16, 30)
    elif how == "dtype":
        tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(16, 32, dtype=torch.int32)
    if how == "truncated":
        size = os.path.getsize(file)
        with open(file, "r+b") as f:
            f.truncate(size - 64)
    elif how == "pickle":
        os.remove(file)
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    elif how == "remote":
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    else:
        safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})


def _load_error(path):
    warnings.simplefilter("ignore")
    try:
        functp.from_pretrained(path, functp.make_mesh((2,), ("tp",)))
    except functp.CheckpointError as e:
        return str(e)
    return "loaded"


_BAD = {"missing": ("model.layers.1.mlp.down_proj.weight", "holds no tensor"),
        "shape": ("model.layers.1.mlp.down_proj.weight", "(16, 30)"),
        "dtype": ("model.layers.1.mlp.down_proj.weight", "I32"),
        "truncated": ("model.safetensors", "truncated"),
        "pickle": ("pytorch_model.bin", "safetensors' converter"),
        "remote": ("auto_map", "trust_remote_code=True")}


@pytest.mark.parametrize("how", list(_BAD))
def test_a_bad_checkpoint_is_a_checkpoint_error_on_every_rank(run, tmp_path, how):
    path = _save(tmp_path, "llama")
    _damage(path, how)
    messages = run(2, _load_error, path, gloo=True)
    what, why = _BAD[how]
    for rank, m in enumerate(messages):
        assert what in m and why in m, f"rank {rank}: {m}"
        assert how in ("pickle", "remote") or path in m, m


# -- meta-device models and parameters held once ----------------------------------------


def _meta_llama():
    config = transformers.LlamaConfig(**{**_COMMON, "num_key_value_heads": 4})   # tp=4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)


def _init_full(shape, names):
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh(shape, names)
    apply, meta, specs = functp.parallelize(_meta_llama(), mesh, "auto")
    assert all(b.is_meta for b in meta.values())
    params = functp.init_blocks(apply, seed=3)
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in meta.items()}
    assert not any(p.is_meta for p in params.values())
    return apply.unshard(params)


def test_init_blocks_gives_the_same_full_model_on_any_mesh(run):
    a = run(4, _init_full, (2, 2), ("dp", "tp"))[0]
    b = run(4, _init_full, (1, 4), ("dp", "tp"))[0]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(a["model.norm.weight"], torch.ones(16))          # the model's own init
    w = a["model.layers.0.mlp.down_proj.weight"]
    assert abs(w.std().item() - 0.02) < 0.005 and not torch.equal(
        w, a["model.layers.1.mlp.down_proj.weight"])                      # per-module seeds


def _held_once(path):
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh((2,), ("tp",))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **EAGER)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **EAGER)
    norm = model.model.norm.weight
    apply, params, specs = functp.parallelize(model, mesh, "auto", keep_module=False)
    shared = params["model.norm.weight"].data_ptr() == norm.data_ptr()
    released = model.model.layers[0].mlp.down_proj.weight.is_meta
    try:
        model(torch.zeros(1, 4, dtype=torch.long))
        called = "ran"
    except functp.ShardingError as e:
        called = str(e)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    step = functp.shard_map(lambda p, i: apply(p, input_ids=i, use_cache=False).logits.sum(),
                            mesh, in_specs=(specs, P()), out_specs=P())
    err = (step(params, ids) - ref(input_ids=ids, use_cache=False).logits.sum()).abs().item()
    return shared, released, called, err


def test_keep_module_false_holds_each_parameter_once(run, tmp_path):
    path = _save(tmp_path, "llama")
    shared, released, called, err = run(2, _held_once, path)[0]
    assert shared, "a replicated parameter's block should be the module's own tensor"
    assert released, "a split parameter's full tensor should be released (meta)"
    assert "weights were released" in called, called
    assert err < 1e-10, err


# -- saving back -----------------------------------------------------------------------


def _round_trip(path, out, shape, names):
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh(shape, names)
    apply, params, specs = functp.from_pretrained(path, mesh, **EAGER)
    functp.save_pretrained(out, params, specs, mesh, apply.module.config)
    return sorted(os.listdir(out))


@pytest.mark.parametrize("kind,shape,names", [("phi3", (2, 2), ("dp", "tp")),
                                              ("qwen3_moe", (2,), ("tp",)),
                                              ("gemma", (2,), ("fsdp",))])
def test_save_pretrained_round_trips_bit_exactly_through_transformers(run, tmp_path, kind,
                                                                       shape, names):
    path, out = _save(tmp_path, kind), str(tmp_path / "saved")
    files = run(len(names) * 2, _round_trip, path, out, shape, names, gloo=True)[0]
    assert "config.json" in files and sum(f.endswith(".safetensors") for f in files) > 1, files
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = transformers.AutoModelForCausalLM.from_pretrained(path, **EAGER)
        b = transformers.AutoModelForCausalLM.from_pretrained(out, **EAGER)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# -- examples/finetune_hf.py -----------------------------------------------------------


def _example():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "finetune_hf.py")
    spec = importlib.util.spec_from_file_location("example_finetune_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind,mesh", [("llama", "2x2"), ("qwen3_moe", "1x2")])
def test_finetune_example_trains_and_saves_a_model_transformers_loads(tmp_path, kind, mesh):
    import contextlib
    import io
    path, out = _save(tmp_path, kind), tmp_path / "run"
    module = _example()
    args = [path, "--mesh", mesh, "--steps", "12", "--batch", "4", "--seq", "16",
            "--lr", "3e-3", "--out", str(out)]
    threads, text = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            fell = functp.simulate(module.main, 4 if mesh == "2x2" else 2, args)
    finally:
        torch.set_num_threads(threads)            # main() sets one thread
    assert all(fell), text.getvalue()
    assert "tokens/s" in text.getvalue() and "fine-tuned model" in text.getvalue()
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    assert [r["step"] for r in rows] == list(range(1, 13))
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) < sum(losses[:3]), losses          # it learns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = transformers.AutoModelForCausalLM.from_pretrained(path)
        after = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    a, b = before.state_dict(), after.state_dict()
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)


def test_a_missing_safetensors_names_the_hf_extra(monkeypatch):
    import importlib.util
    from functp.io import _safetensors
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "safetensors" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"needs safetensors: pip install 'functp\[hf\]'"):
        _safetensors.require_hf("functp.from_pretrained")


def _with_config(path):
    warnings.simplefilter("ignore")
    apply, params, specs = functp.from_pretrained(
        path, distributed_config={"tp_size": 2, "tp_plan": "auto"}, dtype=torch.float64, **EAGER)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **EAGER)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    out = functp.shard_map(lambda p, i: apply(p, input_ids=i, use_cache=False).logits,
                           apply.mesh, in_specs=(specs, P()), out_specs=P())(params, ids)
    return apply.mesh.axis_names, (out - ref(input_ids=ids, use_cache=False).logits).abs().max().item()


def test_a_distributed_config_makes_the_mesh_as_in_transformers(run, tmp_path):
    names, err = run(2, _with_config, _save(tmp_path, "llama"))[0]
    assert names == ("dp_replicate", "fsdp", "tp") and err < 1e-12, (names, err)


def _compare_cp(path, strategy):
    """from_pretrained on a cp mesh (issue 53, item 2): apply takes whole sequences and
    returns this rank's block of the logits; the worst relative error of the loss and
    of each gradient against transformers' own model (SDPA: float64 throughout)."""
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh((2,), ("cp",))
    plan = "auto" if strategy == "allgather" else {"cp": functp.ContextParallel(strategy)}
    sdpa = dict(attn_implementation="sdpa")
    apply, params, specs = functp.from_pretrained(path, mesh, plan, dtype=torch.float64, **sdpa)
    ids, tgt, ref_grads, ref_loss = _reference(path, **sdpa)
    cp = apply.context_parallel

    def local(p, i, t):
        logits = apply(p, input_ids=i, use_cache=False).logits
        total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), cp.block(t).flatten(),
                                                  reduction="sum")
        return functp.psum(total, "cp") / t.numel()
    step = functp.shard_map(local, mesh, in_specs=(specs, P(), P()), out_specs=P())
    grads, loss = torch.func.grad_and_value(step)(params, ids, tgt)
    return _worst(apply.unshard(grads), loss, ref_grads, ref_loss)


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_loads_onto_a_cp_mesh_with_transformers_models_gradients(run, tmp_path, strategy):
    path = _save(tmp_path, "llama")
    worst = run(2, _compare_cp, path, strategy, gloo=True)[0]
    assert worst < 1e-10, f"llama from_pretrained on cp=2 ({strategy}): differs by {worst:.2e}"
