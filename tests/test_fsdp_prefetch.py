"""FSDP forward prefetch: a FullyShard module's pre-hook also gathers the next module's
blocks (the plan's module order, checked on the first call).

Checked against the unsharded float64 model (loss and every gradient) on the second
call, where the modules prefetch, through ``torch.func.grad`` and tape autograd; the
order of gathers and compute; one gather and one reduce-scatter per parameter; and
the fall-back to gathering at use where modules run out of the plan's order.

Also FullyShard's free after forward (transformers' ``free_full_weight``): under tape
autograd the gathered weights do not outlive the forward and are gathered again in
the backward, with the same gradients; kept under torch.func and in checkpointed
regions."""
from __future__ import annotations

import warnings
import weakref

import pytest
import torch
import torch.utils.checkpoint

import functp
from functp import FullyShard, P
from functp.models import LLAMA_TP_PLAN, Llama, LlamaConfig
from _oracle import grads_and_loss
from _fsdp import _MESHES, _groups, _loss, _max_error


def _watch(model, specs, box):
    """Forward pre-hooks (after the plan's) on every module that owns a parameter the
    plan shards over fsdp: [(module name, all-gathers in the comm_log ``box[0]``
    before its compute)], and each such module's gather group (all float64: one
    gather per group)."""
    seen, own = [], _groups(model, specs)
    for name in own:
        model.get_submodule(name).register_forward_pre_hook(lambda *_, name=name: seen.append(
            (name, sum(1 for e in box[0] if e.op == "all_gather" and "fsdp" in e.axes))))
    return seen, own


def _cumulative(seen, own, ahead: int) -> list:
    """The gathers issued before each module's compute when a group's first module
    gathers the whole group, and the next ``ahead`` groups too (0: its own only)."""
    groups = list(dict.fromkeys(own[n] for n, _ in seen))      # in their first-run order
    arrived, out = set(), []
    for name, _ in seen:
        arrived.add(own[name])
        out.append(min(len(arrived) + ahead, len(groups)))
    return out


def _llama_case(mesh_name, tape, prefetch):
    shape, names = _MESHES[mesh_name]
    torch.manual_seed(0)
    model = Llama(LlamaConfig()).double()
    mesh = functp.make_mesh(shape, names)
    style = FullyShard(mesh.axis_size("fsdp"), ("dp_replicate",) if "dp_replicate" in names
                       else (), prefetch=prefetch)
    plan = {"fsdp": style, **({"tp": LLAMA_TP_PLAN} if "tp" in names else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply, params, specs = functp.parallelize(model, mesh, plan)
    g = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(3, 32, (8, 6), generator=g), torch.randint(32, (8, 6), generator=g)
    batch = apply.batch_axes
    local = functp.shard((ids, tgt), mesh, P(batch))
    step = functp.shard_map(lambda p, i, t: functp.pmean(_loss(apply(p, i), t), batch),
                            mesh, in_specs=(specs, P(batch), P(batch)), out_specs=P())
    box = [None]
    seen, own = _watch(model, specs, box)
    with functp.comm_log() as box[0]:
        step(params, *local)              # the first call: checks the order, no prefetch
    first = list(seen)
    seen.clear()
    with functp.comm_log() as log:
        box[0] = log
        grads, loss = grads_and_loss(step, params, *local, tape=tape)
    seen = list(seen)                   # (the reference below runs the hooks too)
    ref_apply, full = functp.functionalize(model)
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: _loss(ref_apply(p, ids), tgt))(full)
    n = len(set(own.values()))
    full_grads = apply.unshard(grads)
    return (abs(loss.item() - ref_loss.item()), _max_error(full_grads, ref_grads),
            first, seen, own, log.summary(), n, full_grads)


@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
@pytest.mark.parametrize("mesh_name", list(_MESHES))
def test_prefetch_is_exact_and_gathers_one_module_ahead(run, mesh_name, tape):
    shape, _ = _MESHES[mesh_name]
    world = shape[0] * (shape[1] if len(shape) > 1 else 1)
    loss_err, grad_err, first, seen, own, log, n, _ = run(world, _llama_case, mesh_name, tape,
                                                       True)[0]
    assert loss_err < 1e-12 and grad_err < 1e-10, (loss_err, grad_err)
    assert len(seen) == len(own) > n > 2
    # first call: each group's first module gathers the group's blocks; later: the
    # next group's too
    assert [c for _, c in first] == _cumulative(first, own, 0)
    assert [c for _, c in seen] == _cumulative(seen, own, 1)
    # still one gather and one reduce-scatter per group (none left unused)
    assert log[("all_gather", ("fsdp",))] == n == log[("reduce_scatter", ("fsdp",))]


@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
def test_prefetch_off_gathers_at_use_with_the_same_gradients(run, tape):
    on = run(2, _llama_case, "fsdp2", tape, True)[0]
    off = run(2, _llama_case, "fsdp2", tape, False)[0]
    assert off[1] < 1e-10 and on[1] < 1e-10
    assert [c for _, c in off[3]] == _cumulative(off[3], off[4], 0)
    assert [c for _, c in on[3]] != [c for _, c in off[3]]
    assert off[5] == on[5]           # the same collectives, in number
    assert all(torch.equal(on[7][k], off[7][k]) for k in off[7])     # bit for bit


class _Stack(torch.nn.Module):
    """Linear layers whose forward may run them out of their registration order, skip
    one, or run one twice."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, order=(0, 1, 2, 3)):
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x


def _order_case(orders, tape):
    """One step per entry of ``orders`` (the layers' run order); per step: the
    gradient's error against the unsharded model, the gathers before each layer's
    compute, and the gathers and reduce-scatters issued."""
    torch.manual_seed(0)
    model = _Stack().double()
    mesh = functp.make_mesh((2,), ("fsdp",))
    apply, params, specs = functp.parallelize(model, mesh, {"fsdp": "auto"})
    x = torch.randn(4, 8, dtype=torch.float64)
    ref_apply, full = functp.functionalize(model)
    out, box = [], [None]
    seen, _ = _watch(model, specs, box)
    for order in orders:
        step = functp.shard_map(
            lambda p, x: functp.pmean(apply(p, x, order).square().mean(), "fsdp"),
            mesh, in_specs=(specs, P("fsdp")), out_specs=P())
        seen.clear()
        with functp.comm_log() as log:
            box[0] = log
            xs = functp.shard(x, mesh, P("fsdp"))
            if tape:
                p = {k: v.detach().requires_grad_() for k, v in params.items()}
                step(p, xs).backward()
                grads = {k: v.grad if v.grad is not None else torch.zeros_like(v)
                         for k, v in p.items()}
            else:
                grads = torch.func.grad(step)(params, xs)
        counts = [c for _, c in seen]       # (the reference below runs the hooks too)
        ref = torch.func.grad(lambda p: ref_apply(p, x, order).square().mean())(full)
        s = log.summary()
        out.append((_max_error(apply.unshard(grads), ref), counts,
                    s.get(("all_gather", ("fsdp",)), 0), s.get(("reduce_scatter", ("fsdp",)), 0)))
    return out


@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
def test_the_gather_of_layer_i_plus_1_is_issued_before_layer_i_computes(run, tape):
    steps = run(2, _order_case, [(0, 1, 2, 3)] * 3, tape)[0]
    for err, _, ag, rs in steps:
        assert err < 1e-12 and ag == 4 == rs         # a layer's weight and bias at once
    assert steps[0][1] == [1, 2, 3, 4]               # the first call: each at its own
    assert steps[1][1] == steps[2][1] == [2, 3, 4, 4]   # then one layer ahead


def test_modules_out_of_the_plan_order_gather_at_use(run):
    # the first call runs 0, 2, 3, 1: only 2 -> 3 is in the plan's order
    steps = run(2, _order_case, [(0, 2, 3, 1), (0, 2, 3, 1), (0, 1, 2, 3)], False)[0]
    for err, _, ag, rs in steps:
        assert err < 1e-12 and ag == 4 == rs
    assert steps[0][1] == [1, 2, 3, 4]
    assert steps[1][1] == [1, 3, 3, 4]      # layer 2's pre-hook gathers 3's blocks too
    assert steps[2][1] == [1, 2, 4, 4]      # in the plan's order now: still only 2 -> 3


@pytest.mark.parametrize("order,seen,counts,after", [
    # layer 2 runs before 1: 1 uses the gather 0 prefetched for it; 1 does not
    # prefetch 2, which ran already. Then 0 -> 1, 2 -> 1 and 1 -> 3 are off
    ((0, 2, 1, 3), [2, 4, 4, 4], (4, 4), [1, 2, 3, 4]),
    # layer 1 skipped: its prefetched gather has no use, so no gradient flows through
    # it and no reduce-scatter is issued for it (on every rank alike); then 0 -> 1 is off
    ((0, 2, 3), [2, 4, 4], (4, 3), [1, 3, 3]),
    # layer 3 run twice: the second call of it gathers its own blocks again
    ((0, 1, 2, 3, 3), [2, 3, 4, 4, 5], (5, 5), [2, 3, 4, 4, 5])],
    ids=["later", "skipped", "twice"])
def test_a_layer_that_runs_out_of_order_after_the_check(run, order, seen, counts, after):
    steps = run(2, _order_case, [(0, 1, 2, 3), order, order], False)[0]
    for err, *_ in steps:
        assert err < 1e-12
    assert steps[1][1] == seen and steps[1][2:] == counts
    # a pair seen out of order prefetches no more
    assert steps[2][1] == after and steps[2][2] == steps[2][3] == counts[1]


def _wrong_size():
    mesh = functp.make_mesh((2,), ("fsdp",))
    with pytest.raises(functp.ShardingError, match=r"FullyShard\(size=4.*'fsdp' has size 2"):
        functp.parallelize(_Stack(), mesh, {"fsdp": FullyShard(4)})


def test_a_fully_shard_family_of_the_wrong_size_raises_on_every_rank(run):
    run(2, _wrong_size)


# -- free after forward (transformers' free_full_weight) -------------------------------------

class _CheckpointedStack(_Stack):
    def forward(self, x, order=(0, 1, 2, 3)):
        for i in order:
            x = torch.utils.checkpoint.checkpoint(
                lambda x, i=i: torch.tanh(self.layers[i](x)), x, use_reentrant=False)
        return x


def _free_case(mesh_name, how, free=True, stack=_Stack):
    """A 4-layer step whose modules free their gathered weights after the forward:
    the error against the unsharded model, how many gathered weights' storages are
    still alive between forward and backward, and the collectives of the step."""
    shape, names = _MESHES[mesh_name]
    mesh = functp.make_mesh(shape, names)
    torch.manual_seed(0)
    model = stack().double()
    style = FullyShard(mesh.axis_size("fsdp"), ("dp_replicate",) if "dp_replicate" in names
                       else (), free=free)
    apply, params, specs = functp.parallelize(model, mesh, {"fsdp": style})
    stores, watch = [], [True]
    for layer in model.layers:       # (a storage's Python object lives as long as it)
        layer.register_forward_pre_hook(lambda m, _: stores.append(
            weakref.ref(m.weight.untyped_storage())) if watch and how == "tape" else None)
    batch = apply.batch_axes
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    step = functp.shard_map(lambda p, x: functp.pmean(torch.tanh(apply(p, x)).square().mean(),
                                                      batch),
                            mesh, in_specs=(specs, P(batch)), out_specs=P())
    xs = functp.shard(x.detach(), mesh, P(batch)).requires_grad_()
    with torch.no_grad():
        step(params, xs)            # (the order checked: the step below prefetches)
    stores.clear()
    alive = None
    with functp.comm_log() as log:
        if how == "func_grad":
            grads = torch.func.grad(step)(params, xs)
        else:
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            loss = step(p, xs)
            alive = sum(r() is not None for r in stores)
            if how == "create_graph":
                return torch.autograd.grad(loss, list(p.values()), create_graph=True)
            loss.backward()
            grads = {k: v.grad for k, v in p.items()}
    watch.clear()
    ref_apply, full = functp.functionalize(model)
    full = {k: v.detach().requires_grad_() for k, v in full.items()}
    torch.tanh(ref_apply(full, x)).square().mean().backward()     # (checkpoint: no torch.func)
    ref = {k: v.grad for k, v in full.items()}
    s = log.summary()
    return (_max_error(apply.unshard(grads), ref), alive, s.get(("all_gather", ("fsdp",))),
            s.get(("reduce_scatter", ("fsdp",))), s.get(("all_reduce", ("dp_replicate",)), 0))


@pytest.mark.parametrize("mesh_name", ["fsdp2", "replicate2_fsdp2"])
def test_free_full_weight_gathers_again_in_the_tape_backward(run, mesh_name):
    world = 2 if mesh_name == "fsdp2" else 4
    err, alive, ag, rs, hsdp = run(world, _free_case, mesh_name, "tape")[0]
    keep = run(world, _free_case, mesh_name, "tape", False)[0]
    assert err < 1e-12 and keep[0] < 1e-12
    # kept: the 4 weights autograd saves; freed: none outlives the forward
    assert keep[1] == 4 and alive == 0
    # 4 gathers in the forward (a layer's weight and bias at once), and each saved
    # weight's again in the backward; one reduce-scatter per layer either way (HSDP:
    # the blocks' all-reduces as kept)
    assert keep[2] == 4 and ag == 8 and rs == keep[3] == 4 and hsdp == keep[4]


def test_free_full_weight_keeps_the_weights_under_torch_func(run):
    err, _, ag, rs, _ = run(2, _free_case, "fsdp2", "func_grad")[0]
    assert err < 1e-12 and ag == 4 == rs


def _free_create_graph():
    with pytest.raises(functp.ShardingError, match="'layers.3' frees its gathered weights.*"
                                                   "create_graph=True"):
        _free_case("fsdp2", "create_graph")


def test_free_full_weight_refuses_a_differentiated_backward(run):
    run(2, _free_create_graph)


def _hf_free(fsdp_plan):
    """A transformers Llama under "auto" on an fsdp mesh (the model's fsdp_plan), or
    from a DistributedConfig whose ``fsdp_plan`` overrides it."""
    import _hf as hf
    from _fsdp import _step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf._build("llama")
    mesh, config = functp.make_mesh((2,), ("fsdp",)), None
    if fsdp_plan is not None:
        mesh, config = None, dict(fsdp_size=2, fsdp_plan=fsdp_plan)
    (loss, grads, fwd, log, specs, apply, _), (ref_loss, ref_grads) = _step(
        model, mesh, "auto", True, lambda a, p, i: a(p, input_ids=i, use_cache=False).logits,
        distributed_config=config)
    n = len(set(_groups(model, specs, {**model.fsdp_plan, **(fsdp_plan or {})}).values()))
    return (hf._max_error(grads, ref_grads, loss, ref_loss), n, fwd.summary(), log.summary())


def test_a_transformers_fsdp_plan_frees_its_layers_weights_under_tape(run):
    pytest.importorskip("transformers")
    (err, where), n, fwd, log = run(2, _hf_free, None)[0]
    assert err < 1e-10, f"{where} differs by {err:.2e}"
    # the model's plan frees the layers' (and the embedding's) weights: the backward
    # gathers the layers' again (the embedding's backward reads no weight)
    assert fwd[("all_gather", ("fsdp",))] == n == log[("reduce_scatter", ("fsdp",))]
    assert log[("all_gather", ("fsdp",))] > n
    # a config's fsdp_plan over the model's: the layers kept, the LM head freed
    (err, _), n, fwd, log = run(2, _hf_free, {"model.layers.*": "keep_full_weight",
                                              "lm_head": "free_full_weight"})[0]
    assert err < 1e-10
    assert log[("all_gather", ("fsdp",))] == n + 1, \
        "the config's fsdp_plan must reach the FSDP family's FullyShard (_fsdp_style)"


def test_free_full_weight_inside_a_checkpointed_region_keeps_the_weights(run):
    # the region's own saved-tensor hooks decide what is saved (and recomputed)
    err, alive, ag, rs, _ = run(2, _free_case, "fsdp2", "tape", True, _CheckpointedStack)[0]
    assert err < 1e-12 and ag == 4 == rs


def _checkpointed_under_func_grad():
    with pytest.raises(functp.ShardingError) as info:
        _free_case("fsdp2", "func_grad", False, _CheckpointedStack)
    return str(info.value)


def test_torch_utils_checkpoint_under_torch_func_names_the_cause_and_the_fix(run):
    # torch.func takes no saved-tensor hooks, which torch.utils.checkpoint records
    # with: the plan is not the cause, and its children's rules are no fix
    for msg in run(2, _checkpointed_under_func_grad):
        assert "saved-tensor hooks" in msg and "functp.checkpoint" in msg, msg
        assert "loss.backward()" in msg and "children rules" not in msg, msg


_SHARED = FullyShard(2)      # one style for every rank's plan (each rank its own model)


def _shared_style():
    torch.manual_seed(0)
    model = _Stack().double()
    mesh = functp.make_mesh((2,), ("fsdp",))
    apply, params, specs = functp.parallelize(model, mesh, {"fsdp": _SHARED})
    step = functp.shard_map(lambda p, x: functp.pmean(apply(p, x).square().mean(), "fsdp"),
                            mesh, in_specs=(specs, P("fsdp")), out_specs=P())
    xs = functp.shard(torch.randn(4, 8, dtype=torch.float64), mesh, P("fsdp"))
    box = [None]
    seen, _ = _watch(model, specs, box)
    for _ in range(2):
        seen.clear()
        with functp.comm_log() as box[0]:
            torch.func.grad(step)(params, xs)
    # (after the steps' collectives: both ranks have registered their modules)
    return [c for _, c in seen], [id(m) for m in _SHARED._gathers.order.mods.values()], \
        [id(m) for m in model.layers]


def test_a_style_shared_by_simulated_ranks_keeps_each_ranks_order(run):
    for seen, order, layers in run(2, _shared_style):
        # each rank's plan order holds its own modules only (interleaved with the other
        # rank's, a rank's successor could be the other's module: no prefetch, or, by
        # the threads' timing, a different collective order on each rank)
        assert order == layers and seen == [2, 3, 4, 4]


class _FrozenFirst(torch.nn.Module):
    """A frozen layer run under no_grad inside the forward, then a trained one: the
    frozen layer's pre-hook prefetches the next layer's gather without a graph."""

    def __init__(self):
        super().__init__()
        self.frozen, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            x = torch.tanh(self.frozen(x))
        return self.head(x)


class _RematLayers(torch.nn.Module):
    """Layers under functp.checkpoint one by one (whose first run is under no_grad)
    and a head outside, as gradient checkpointing leaves a model's norm and LM head."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        for layer in self.layers:
            x = functp.checkpoint(lambda x, layer=layer: torch.tanh(layer(x)))(x)
        return self.head(x)


def _grad_mode_case(model_cls, tape):
    torch.manual_seed(0)
    model = model_cls().double()
    mesh = functp.make_mesh((2,), ("fsdp",))
    apply, params, specs = functp.parallelize(model, mesh, {"fsdp": "auto"})
    x = torch.randn(4, 8, dtype=torch.float64)
    step = functp.shard_map(lambda p, x: functp.pmean(apply(p, x).square().mean(), "fsdp"),
                            mesh, in_specs=(specs, P("fsdp")), out_specs=P())
    xs = functp.shard(x, mesh, P("fsdp"))
    ref_apply, full = functp.functionalize(model)
    ref = torch.func.grad(lambda p: ref_apply(p, x).square().mean())(full)
    errs = []
    for _ in range(2):              # the second call prefetches
        if tape:
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            step(p, xs).backward()
            grads = {k: torch.zeros_like(v) if v.grad is None else v.grad
                     for k, v in p.items()}
        else:
            grads = torch.func.grad(step)(params, xs)
        errs.append(_max_error(apply.unshard(grads), ref))
    return errs


@pytest.mark.parametrize("model_cls", [_FrozenFirst, _RematLayers], ids=["frozen", "remat"])
@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
def test_a_gather_prefetched_under_no_grad_is_not_used_with_grad(run, model_cls, tape):
    # the head's gather, prefetched by the layer before it under no_grad, has no
    # graph: used, the head's gradient would be lost (tape: the loss had no grad_fn)
    for errs in run(2, _grad_mode_case, model_cls, tape):
        assert max(errs) < 1e-12, errs


@pytest.mark.parametrize("free", ["keep_full_weight", {"layers.*": "free"}, 1])
def test_a_bad_free_argument_is_refused(free):
    # a string is truthy: taken as a bool, "keep_full_weight" would free every module
    with pytest.raises(functp.ShardingError, match="free must be a bool or transformers'"):
        FullyShard(2, free=free)
