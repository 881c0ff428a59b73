"""The whole training step (gradients, clip_by_global_norm, a functional optimizer's
update) as one function: functp.adamw / functp.sgd do torch.optim.AdamW's / SGD's
arithmetic on the blocks, so a sharded run trains as the unsharded float64 model with
torch.optim and clip_grad_norm_; compiled with fullgraph=True the step is one graph
with no host read, the eager step's values and collectives; its state checkpoints
across meshes (issue 54)."""
from __future__ import annotations

import copy
import math

import optree
import pytest
import torch

import functp
from functp import P
from _oracle import assert_tree_close, randn
from _programs import B, H, TP_SPECS, _megatron_local, _mlp, _mlp_params, _mse

STEPS, MAX_NORM = 3, 0.5


def _batches(n=STEPS, rows=B):
    return [(randn(rows, H, seed=100 + i), randn(rows, H, seed=200 + i)) for i in range(n)]


def _torch_opt(kind: str, params, kw):
    return (torch.optim.AdamW if kind == "adamw" else torch.optim.SGD)(params, **kw)


def _functp_opt(kind: str, kw):
    return (functp.adamw if kind == "adamw" else functp.sgd)(**kw)


# -- the optimizers alone: torch.optim's arithmetic, bit for bit --------------------------

_ADAMW = [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6),
          dict(lr=1e-2, weight_decay=0.1, amsgrad=True)]
_SGD = [dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.1, momentum=0.9, weight_decay=0.01,
                                                        dampening=0.3),
        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)]
_CASES = [("adamw", kw) for kw in _ADAMW] + [("sgd", kw) for kw in _SGD]


@pytest.mark.parametrize("kind,kw", _CASES, ids=[f"{k}-{'-'.join(map(str, kw.items()))}"
                                                 for k, kw in _CASES])
def test_the_update_is_torch_optims_arithmetic(kind, kw):
    params = {"w": randn(4, 3, seed=1), "b": [randn(5, seed=2)]}
    grads = [optree.tree_map(lambda x: torch.randn_like(x), params) for _ in range(4)]
    leaves = [x.clone().requires_grad_() for x in optree.tree_leaves(params)]
    ref = _torch_opt(kind, leaves, kw)
    for g in grads:
        for x, gx in zip(leaves, optree.tree_leaves(g)):
            x.grad = gx.clone()
        ref.step()
    for donate in (False, True):
        opt = _functp_opt(kind, kw)
        p = optree.tree_map(torch.clone, params)
        state = opt.init(p)
        before = optree.tree_map(torch.clone, (p, state))
        for g in grads:
            new_p, new_state = opt.update(p, g, state, donate=donate)
            if not donate:      # the arguments are left as they were
                assert_tree_close((p, state), before, "arguments of update(donate=False)",
                                  tol=dict(rtol=0, atol=0))
            else:               # written into the caller's own tensors
                assert all(a is b for a, b in zip(optree.tree_leaves(new_p), optree.tree_leaves(p)))
            p, state = new_p, new_state
            before = optree.tree_map(torch.clone, (p, state))
        got = optree.tree_leaves(p)
        # (torch.optim's addcdiv rounds step_size * m / denom in one kernel, this as two
        # foreach ops: an ulp apart at most)
        assert_tree_close(got, [x.detach() for x in leaves], f"{kind} {kw} donate={donate}",
                          dict(rtol=1e-14, atol=1e-15))
        assert state["step"].item() == len(grads) and state["step"].dtype == torch.int64


def test_a_tensor_or_scheduled_learning_rate_is_torch_optims_with_a_scheduler():
    params = {"w": randn(6, seed=3)}
    grads = [{"w": randn(6, seed=10 + i)} for i in range(5)]
    warm = lambda s: min(1.0, (s + 1) / 3)               # noqa: E731 - LambdaLR's factor
    x = params["w"].clone().requires_grad_()
    ref = torch.optim.AdamW([x], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(ref, warm)
    for g in grads:
        x.grad = g["w"].clone()
        ref.step()
        sched.step()
    # the schedule is a function of the step tensor, written with torch ops
    opt = functp.adamw(lambda s: 1e-2 * torch.clamp((s + 1) / 3, max=1.0))
    lr = torch.tensor(0.0, dtype=torch.float64)
    by_tensor = functp.adamw(lr)
    p, state, q, qstate = params, opt.init(params), params, by_tensor.init(params)
    for i, g in enumerate(grads):
        p, state = opt.update(p, g, state)
        lr.fill_(1e-2 * warm(i))                         # changed in place: no recompile
        q, qstate = by_tensor.update(q, g, qstate)
    assert_tree_close(p["w"], x.detach(), "schedule")
    assert_tree_close(q["w"], x.detach(), "tensor lr")


def test_bad_arguments_are_refused_by_name():
    opt = functp.adamw(1e-3)
    p = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    state = opt.init(p)
    with pytest.raises(functp.ShardingError, match=r"grads\['w'\] \(shape \(2, 3\)\).*params\['w'\] \(shape \(3, 2\)\)"):
        opt.update(p, {"w": torch.zeros(2, 3), "b": torch.zeros(2)}, state)
    with pytest.raises(functp.ShardingError, match="grads have the structure"):
        opt.update(p, {"w": torch.zeros(3, 2)}, state)
    with pytest.raises(functp.ShardingError, match=r"state has \['step'\].*init"):
        opt.update(p, p, {"step": state["step"]})
    small = opt.init({"w": torch.zeros(3, 1), "b": torch.zeros(2)})
    with pytest.raises(functp.ShardingError, match=r"state\['exp_avg'\]\['w'\].*opt.specs"):
        opt.update(p, p, small)
    with pytest.raises(functp.ShardingError, match=r"params\['n'\] is torch.int64"):
        opt.init({"n": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(functp.ShardingError, match="lr=-1.*schedule"):
        functp.adamw(-1)
    with pytest.raises(functp.ShardingError, match="betas\\[1\\]=1"):
        functp.adamw(1e-3, betas=(0.9, 1))
    with pytest.raises(functp.ShardingError, match="nesterov=True needs momentum"):
        functp.sgd(0.1, nesterov=True)
    assert functp.sgd(0.1, momentum=0.9).specs({"w": P("tp")}) == {
        "step": P(), "momentum_buffer": {"w": P("tp")}}


# -- sharded programs train as the unsharded model with torch.optim + clip_grad_norm_ -------


def _reference(global_fn, params: dict, batches, kind: str, kw: dict) -> dict:
    """The unsharded float64 program trained with torch.optim and clip_grad_norm_."""
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = _torch_opt(kind, list(leaves.values()), kw)
    for x, y in batches:
        opt.zero_grad()
        global_fn(leaves, x, y).backward()
        torch.nn.utils.clip_grad_norm_(list(leaves.values()), MAX_NORM)
        opt.step()
    return {k: v.detach() for k, v in leaves.items()}


def _grads_by(way: str, step):
    """``f(params, *args) -> grads`` for a way of taking gradients."""
    if way == "torch.func.grad":
        return torch.func.grad(step)
    if way == "functp.value_and_grad":
        return lambda p, *a: functp.value_and_grad(step)(p, *a)[1]

    def tape(p, *a):
        p = {k: v.detach().requires_grad_() for k, v in p.items()}
        return dict(zip(p, torch.autograd.grad(step(p, *a), list(p.values()))))
    return tape


def _train(step, params, specs, mesh, batch_spec, batches, kind, kw, way):
    grads_of = _grads_by(way, step)
    opt = _functp_opt(kind, kw)
    state = opt.init(params)
    for x, y in batches:
        xs, ys = functp.shard((x, y), mesh, batch_spec)
        g = grads_of(params, xs, ys)
        g, _ = functp.clip_by_global_norm(g, MAX_NORM, mesh, specs)
        params, state = opt.update(params, g, state, donate=True)
    return params, state, opt


def _fsdp_local(p, x, y):
    full = {k: functp.all_gather(v, "dp", tiled=True) for k, v in p.items()}
    return functp.pmean(_mse(_mlp(full, x), y), "dp")


def _program(layout: str, shape: tuple):
    """(mesh, local loss, param specs, batch spec) of a hand-written layout of the MLP."""
    if layout == "tp":
        return functp.make_mesh(shape, ("tp",)), _megatron_local, TP_SPECS, P()
    if layout == "dp_tp":
        return (functp.make_mesh(shape, ("dp", "tp")),
                lambda p, x, y: _megatron_local(p, x, y, dp="dp"), TP_SPECS, P("dp"))
    return functp.make_mesh(shape, ("dp",)), _fsdp_local, P("dp"), P("dp")


def _layout_body(layout, shape, kind, kw, way):
    mesh, local, specs, batch_spec = _program(layout, shape)
    params, batches = _mlp_params(), _batches()
    ref = _reference(lambda p, x, y: _mse(_mlp(p, x), y), params, batches, kind, kw)
    step = functp.shard_map(local, mesh, in_specs=(specs, batch_spec, batch_spec), out_specs=P())
    got, state, opt = _train(step, functp.shard(params, mesh, specs), specs, mesh, batch_spec,
                             batches, kind, kw, way)
    assert_tree_close(functp.unshard(got, mesh, specs), ref, f"{layout} {shape} {kind} {way}")
    # the state is laid out by opt.specs: its unsharded moments are the full tensors'
    full_state = functp.unshard(state, mesh, opt.specs(specs))
    assert all(v.shape == params[k].shape for m in opt.moments for k, v in full_state[m].items())


_ADAM_KW = dict(lr=1e-2, weight_decay=0.1)
_LAYOUTS = [
    ("tp", (2,), "adamw", _ADAM_KW, "torch.func.grad"),
    ("tp", (4,), "sgd", dict(lr=0.1, momentum=0.9, nesterov=True), "tape"),
    ("dp_tp", (2, 2), "adamw", dict(lr=1e-2, amsgrad=True), "functp.value_and_grad"),
    ("dp_tp", (2, 4), "adamw", _ADAM_KW, "tape"),
    ("fsdp", (4,), "adamw", _ADAM_KW, "functp.value_and_grad"),
    ("fsdp", (2,), "sgd", dict(lr=0.1, momentum=0.5, dampening=0.1, weight_decay=0.01),
     "torch.func.grad"),
]


@pytest.mark.parametrize("layout,shape,kind,kw,way", _LAYOUTS, ids=[
    f"{c[0]}{'x'.join(map(str, c[1]))}-{c[2]}-{c[4]}" for c in _LAYOUTS])
def test_a_sharded_program_trains_as_the_unsharded_one_with_torch_optim(run, layout, shape,
                                                                        kind, kw, way):
    run(math.prod(shape), _layout_body, layout, shape, kind, kw, way)


def _ep_body(shape, names, way):
    # a planned model: a tensor-parallel MLP and a Llama MoE whose experts are split
    # over ep (ragged dispatch), trained three steps
    from _moe import _batch, _block
    from test_ep import _plan
    mesh = functp.make_mesh(shape, names)
    module = _block(4)
    ref_module = copy.deepcopy(module)
    apply, params, specs = functp.parallelize(module, mesh, _plan(mesh, functp.ExpertDispatch()))
    batch = apply.batch_axes
    xs = [_batch(2 * mesh.axis_size(batch)) * (1 + i) for i in range(STEPS)]
    opt_ref = torch.optim.AdamW(ref_module.parameters(), **_ADAM_KW)
    for x in xs:
        opt_ref.zero_grad()
        (ref_module(x) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref_module.parameters(), MAX_NORM)
        opt_ref.step()
    step = functp.shard_map(lambda p, x, _: functp.pmean((apply(p, x) ** 2).mean(), batch),
                            mesh, in_specs=(specs, P(batch), P()), out_specs=P())
    grads_of, opt = _grads_by(way, step), functp.adamw(**_ADAM_KW)
    state = opt.init(params)
    for x in xs:
        g = grads_of(params, functp.shard(x, mesh, P(batch)), torch.zeros(()))
        g, _ = functp.clip_by_global_norm(g, MAX_NORM, mesh, specs)
        params, state = opt.update(params, g, state)
    assert_tree_close(apply.unshard(params), {k: v.detach() for k, v in
                                              ref_module.named_parameters()}, f"ep {names}")


@pytest.mark.parametrize("shape,names,way", [((2, 2), ("dp", "ep"), "torch.func.grad"),
                                             ((2, 2), ("ep", "tp"), "tape")],
                         ids=["dp2_ep2-func_grad", "ep2_tp2-tape"])
def test_an_expert_parallel_plan_trains_as_the_unsharded_moe(run, shape, names, way):
    run(math.prod(shape), _ep_body, shape, names, way)


# -- compiled: one graph, no host read, the eager step's values and collectives ----------


class _Census:
    """A backend that counts the graphs Dynamo makes, and in the forward/backward graphs
    AOTAutograd makes of them the collectives and host reads (test_compile's census:
    aot_eager, or Inductor with a counting pre-pass)."""

    def __init__(self, inductor: bool = False):
        from test_compile import _GraphCensus
        self.census = _GraphCensus("inductor" if inductor else "aot_eager")
        self.graphs, self.collectives, self.syncs = 0, self.census.collectives, self.census.syncs
        if inductor:
            from torch._inductor.compile_fx import compile_fx as inner
        else:
            inner = self.census.backend

        def backend(gm, example_inputs):
            self.graphs += 1
            return inner(gm, example_inputs)
        self.backend = backend


def _train_step(step, opt, mesh, specs, way: str, donate: bool):
    grads_of = _grads_by(way, step)

    def train_step(params, state, x, y):
        if way == "functp.value_and_grad":
            loss, g = functp.value_and_grad(step)(params, x, y)
        else:
            loss, g = step(params, x, y).detach(), grads_of(params, x, y)
        g, norm = functp.clip_by_global_norm(g, MAX_NORM, mesh, specs)
        params, state = opt.update(params, g, state, donate=donate)
        return loss, norm, params, state
    return train_step


def _compiled_case(layout, way, donate, inductor=False, requires_grad=False, shape=(2,)):
    """Two steps of the compiled train step against two eager ones: one graph compiled
    once (the second call reuses it), no graph break, no host read, the eager step's
    collectives; the values to 1e-10."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    mesh, local, specs, batch_spec = _program(layout, shape)
    step = functp.shard_map(local, mesh, in_specs=(specs, batch_spec, batch_spec), out_specs=P())
    opt = functp.adamw(lambda s: 1e-2 * torch.clamp((s + 1) / 2, max=1.0), weight_decay=0.1)
    params = functp.shard(_mlp_params(), mesh, specs)
    if requires_grad:          # nn.Parameter-like leaves
        params = {k: v.requires_grad_() for k, v in params.items()}
    batches = [functp.shard(b, mesh, batch_spec) for b in _batches(2)]
    eager_step = _train_step(step, opt, mesh, specs, way, False)
    p, s = params, opt.init(params)
    eager = []
    with functp.comm_log() as log:
        for x, y in batches:
            out = eager_step(p, s, x, y)
            p, s = out[2], out[3]
            eager.append(optree.tree_map(torch.clone, out))
    torch._dynamo.reset()
    counters.clear()
    census = _Census(inductor)
    compiled = torch.compile(_train_step(step, opt, mesh, specs, way, donate), fullgraph=True,
                             backend=census.backend)
    p = optree.tree_map(lambda v: v.detach().clone().requires_grad_(requires_grad), params)
    s = opt.init(p)
    what = f"{layout} {way} donate={donate} inductor={inductor}"
    old = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.config.trace_autograd_ops = way == "tape"   # autograd.grad in the graph
    try:
        with census.census:
            for (x, y), want in zip(batches, eager):
                out = compiled(p, s, x, y)
                if donate:
                    assert all(a is b for a, b in zip(optree.tree_leaves(out[2]),
                                                      optree.tree_leaves(p))), what
                p, s = out[2], out[3]
                if requires_grad and not donate:     # (a new tensor that needs no grad recompiles)
                    p = optree.tree_map(lambda v: v.requires_grad_(), p)
                assert_tree_close(out, want, what)
    finally:
        torch._dynamo.config.trace_autograd_ops = old
    assert census.graphs == 1, f"{what}: {census.graphs} graphs"
    assert not counters["graph_break"], f"{what}: {dict(counters['graph_break'])}"
    assert not census.syncs, f"{what}: host reads {census.syncs}"
    assert len(census.collectives) == len(log) // 2, (
        f"{what}: the graph issues {sorted(census.collectives)}, an eager step "
        f"{log.summary()} / 2")
    return p, s, opt, specs


def _checkpointed(path, p, s, opt, specs):
    """The compiled tp step's state saved, loaded on an fsdp mesh: the same numbers, and
    the next step from it bit for bit the step from the state moved in memory."""
    tp = functp.make_mesh((2,), ("tp",))
    functp.save(path, {"params": p, "opt": s}, tp, {"params": specs, "opt": opt.specs(specs)})
    mesh, local, fspecs, batch_spec = _program("fsdp", (2,))
    layout = {"params": fspecs, "opt": opt.specs(fspecs)}
    loaded = functp.load(path, mesh, layout)
    full = functp.unshard({"params": p, "opt": s}, tp, {"params": specs, "opt": opt.specs(specs)})
    moved = functp.shard(full, mesh, layout)
    assert_tree_close(loaded, moved, "loaded state", tol=dict(rtol=0, atol=0))
    step = functp.shard_map(local, mesh, in_specs=(fspecs, batch_spec, batch_spec), out_specs=P())
    train = _train_step(step, opt, mesh, fspecs, "torch.func.grad", False)
    x, y = functp.shard(_batches(3)[2], mesh, batch_spec)
    a = train(loaded["params"], loaded["opt"], x, y)
    b = train(moved["params"], moved["opt"], x, y)
    assert_tree_close(a, b, "resumed step", tol=dict(rtol=0, atol=0))
    assert loaded["opt"]["step"].item() == 2


def _compiled_body(path):
    # every way of taking gradients on tp=2 (aot_eager: what functp adds is decided
    # before the backend runs), the fsdp program, leaves that require grad, and one
    # Inductor case with donated buffers
    for way in ("torch.func.grad", "functp.value_and_grad", "tape"):
        got = _compiled_case("tp", way, donate=way == "functp.value_and_grad")
    _compiled_case("fsdp", "torch.func.grad", donate=True, requires_grad=True)
    _compiled_case("tp", "functp.value_and_grad", donate=False, requires_grad=True)
    _compiled_case("tp", "functp.value_and_grad", donate=True, inductor=True)
    _checkpointed(path, *got)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="torch 2.11's Dynamo cannot trace the whole step (\"Polyfill handler "
                           "<method-wrapper '__eq__' of function object> does not have a "
                           "traceable function\"); 2.13 and 2.15 do")
def test_the_compiled_train_step_is_one_graph_equal_to_the_eager_step(run, tmp_path):
    run(2, _compiled_body, str(tmp_path / "ckpt"), gloo=True, timeout=600)


# -- compile breadth: functp.value_and_grad of leaves that require grad ----------------------


def _attention_loss(p, x):
    q, k = x @ p["q"], x @ p["k"]
    return torch.nn.functional.scaled_dot_product_attention(q, k, x).square().sum()


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="Dynamo traces functorch's layer depth from torch 2.13")
def test_compiled_value_and_grad_of_leaves_that_require_grad_asks_no_double_backward():
    # nn.Parameters require grad: torch.func.grad_and_value of them compiled traces the
    # backward of the backward, which SDPA's CPU flash attention does not have
    # ("derivative for ..._flash_attention_for_cpu_backward is not implemented"); at
    # the top, functp.value_and_grad differentiates detached leaves, as its tape does eager
    import torch._dynamo
    p = {"q": torch.randn(8, 8, requires_grad=True), "k": torch.randn(8, 8, requires_grad=True)}
    x = torch.randn(1, 2, 4, 8)
    torch._dynamo.reset()
    value, grads = torch.compile(functp.value_and_grad(_attention_loss), fullgraph=True,
                                 backend="aot_eager")(p, x)
    want_value, want = functp.value_and_grad(_attention_loss)(p, x)
    assert_tree_close((value, grads), (want_value, want), "compiled", dict(rtol=1e-5, atol=1e-5))
    assert not value.requires_grad and not any(g.requires_grad for g in grads.values())
    # nested in a torch.func transform it stays attached: a Hessian's diagonal
    w = randn(3, seed=4)
    f = lambda w: (w.sin() ** 2).sum()                                   # noqa: E731
    hess = lambda w: torch.func.grad(lambda v: functp.value_and_grad(f)(v)[1].sum())(w)  # noqa: E731
    assert_tree_close(torch.compile(hess, fullgraph=True, backend="aot_eager")(w),
                      2 * torch.cos(2 * w), "d/dw sum(grad) under compile")
