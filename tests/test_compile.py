"""Steps with functp collectives compile with fullgraph=True (no graph breaks): a
tape-autograd step, and torch.func.grad_and_value of a shard_map in every canonical
layout, with the unsharded program's gradients."""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P
from _oracle import assert_tree_close, randn

GLOO = True     # gloo processes: compiled graphs wait on collectives inside, where
                # functp.simulate cannot hand the turn to the next rank

SPECS = {"w1": P("tp", None), "b1": P("tp"), "w2": P(None, "tp"), "b2": P()}


def _loss(p, x, y):
    h = torch.tanh(x @ p["w1"].T + p["b1"])
    h = functp.all_gather(h, "tp", axis=1, tiled=True)        # exercise a dim argument
    h = functp.psum_scatter(h, "tp", scatter_dimension=1, tiled=True)
    out = functp.psum(h @ p["w2"].T, "tp") + p["b2"]
    return ((out - y) ** 2).mean()


def _compile_body():
    import torch._dynamo
    mesh = functp.make_mesh((2,), ("tp",))
    params = {"w1": randn(8, 4, seed=1), "b1": randn(8, seed=2), "w2": randn(4, 8, seed=3),
              "b2": randn(4, seed=4)}
    local = {k: v.requires_grad_() for k, v in functp.shard(params, mesh, SPECS).items()}
    x, y = randn(3, 4, seed=5), randn(3, 4, seed=6)
    step = functp.shard_map(_loss, mesh, in_specs=(SPECS, P(), P()), out_specs=P())

    def train_step(p, x, y):
        loss = step(p, x, y)
        return loss.detach(), torch.autograd.grad(loss, list(p.values()))

    eager = train_step(local, x, y)
    torch._dynamo.reset()
    # 1. the forward compiled as one graph; AOTAutograd compiles its backward
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(local, x, y)
    got = (loss.detach(), torch.autograd.grad(loss, list(local.values())))
    assert_tree_close(got, eager, "compiled forward, tape backward")
    # 2. the whole step, torch.autograd.grad included
    torch._dynamo.reset()
    old = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.config.trace_autograd_ops = True
    try:
        got = torch.compile(train_step, fullgraph=True, backend="aot_eager")(local, x, y)
    finally:
        torch._dynamo.config.trace_autograd_ops = old
    assert_tree_close(got, eager, "compiled train step")


def test_tape_autograd_step_compiles_fullgraph(run):
    run(2, _compile_body, timeout=600)


# ---------------------------------------------------------------------------------
# torch.compile(torch.func.grad_and_value(shard_map(...)), fullgraph=True): one graph,
# and the gradients of the unsharded float64 program for sharded and replicated
# parameters alike, in every canonical layout.

def _mlp(p, x):
    return torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]


def _params():
    return {"w1": randn(8, 4, seed=1), "b1": randn(8, seed=2), "w2": randn(4, 8, seed=3),
            "b2": randn(4, seed=4)}


def _global_loss(p, x, y):
    return ((_mlp(p, x) - y) ** 2).mean()


def _dp_loss(p, x, y):                       # params P(), batch P("dp")
    return functp.pmean(((_mlp(p, x) - y) ** 2).mean(), "dp")


def _fsdp_loss(p, x, y):                     # params P("dp") on dim 0, batch P("dp")
    full = {k: functp.all_gather(v, "dp", tiled=True) for k, v in p.items()}
    return functp.pmean(((_mlp(full, x) - y) ** 2).mean(), "dp")


def _tp_loss(p, x, y):                       # Megatron: w1/b1 by rows, w2 by columns
    h = torch.tanh(x @ p["w1"].T + p["b1"])
    out = functp.psum(h @ p["w2"].T, "tp") + p["b2"]
    return ((out - y) ** 2).mean()


def _sp_loss(p, x, y):                       # sequence parallel: batch rows split over tp
    xs = functp.all_gather(x, "tp", tiled=True)
    h = torch.tanh(xs @ p["w1"].T + p["b1"])
    out = functp.psum_scatter(h @ p["w2"].T, "tp", tiled=True) + p["b2"]
    return functp.pmean(((out - y) ** 2).mean(), "tp")


def _tp2d_loss(p, x, y):                     # dp x tp
    return functp.pmean(_tp_loss(p, x, y), "dp")


_TP = {"w1": P("tp", None), "b1": P("tp"), "w2": P(None, "tp"), "b2": P()}
_LAYOUTS = {
    "dp": ((4,), ("dp",), _dp_loss, (P(), P("dp"), P("dp"))),
    "fsdp": ((4,), ("dp",), _fsdp_loss, (P("dp"), P("dp"), P("dp"))),
    "tp": ((4,), ("tp",), _tp_loss, (_TP, P(), P())),
    "sp": ((4,), ("tp",), _sp_loss, (_TP, P("tp"), P("tp"))),
    "dp_tp": ((2, 2), ("dp", "tp"), _tp2d_loss, (_TP, P("dp"), P("dp"))),
}


def _compiled_grad_body(layout):
    shape, names, local_loss, in_specs = _LAYOUTS[layout]
    mesh = functp.make_mesh(shape, names)
    p, x, y = _params(), randn(8, 4, seed=5), randn(8, 4, seed=6)
    ref_grads, ref_loss = torch.func.grad_and_value(_global_loss)(p, x, y)
    step = functp.shard_map(local_loss, mesh, in_specs=in_specs, out_specs=P())
    local = functp.shard((p, x, y), mesh, in_specs)
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(torch.func.grad_and_value(step), fullgraph=True, backend=counter)
    for _ in range(3):     # later calls run the cached graph
        grads, loss = compiled(*local)
        assert_tree_close(loss, ref_loss, f"{layout}: compiled loss")
        assert_tree_close(functp.unshard(grads, mesh, in_specs[0]), ref_grads,
                          f"{layout}: compiled grad")
    assert counter.frame_count == 1, f"{layout}: compiled {counter.frame_count} times, not once"


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_compiled_func_grad_matches_unsharded(run, layout):
    run(4, _compiled_grad_body, layout, timeout=600)


def _compiled_plan_body():
    mesh = functp.make_mesh((2,), ("tp",))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 4)).double()
    apply, params, specs = functp.parallelize(mlp, mesh, {"0": "colwise", "2": "rowwise"})
    x = randn(6, 4, seed=7)
    ref = torch.func.grad(lambda p: (torch.func.functional_call(mlp, p, (x,)) ** 2).mean())(
        dict(mlp.named_parameters()))
    step = functp.shard_map(lambda p, x: (apply(p, x) ** 2).mean(), mesh,
                            in_specs=(specs, P()), out_specs=P())
    torch._dynamo.reset()
    grads = torch.compile(torch.func.grad(step), fullgraph=True, backend="aot_eager")(params, x)
    assert_tree_close(apply.unshard(grads), {k: v.detach() for k, v in ref.items()},
                      "plan: compiled grad")


def test_compiled_func_grad_of_a_plan_matches_unsharded(run):
    run(2, _compiled_plan_body, timeout=600)


# ---------------------------------------------------------------------------------
# A compiled vma body keeps the vma rules: the compiled graphs issue exactly the
# collectives the eager step does (comm_log), and a vma error is raised while compiling.

def _graph_collectives(gm) -> list[str]:
    return [n.target._opname for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "_c10d_functional" and n.target._opname != "wait_tensor"]


def _counting_aot_eager(found: list):
    import functools
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def compiler(gm, example_inputs):
        found.extend(_graph_collectives(gm))
        return boxed_nop(gm, example_inputs)
    return functools.partial(aot_eager, fw_compiler=compiler, bw_compiler=compiler)


def _compiled_matches_eager(step, args, what: str) -> None:
    """``torch.func.grad_and_value(step)`` compiled: the eager values, and the eager
    step's collectives (comm_log) in its graphs."""
    step = torch.func.grad_and_value(step)
    with functp.comm_log() as log:
        eager = step(*args)
    torch._dynamo.reset()
    found: list = []
    got = torch.compile(step, fullgraph=True, backend=_counting_aot_eager(found))(*args)
    assert_tree_close(got, eager, f"{what}: compiled against eager")
    assert len(found) == len(log), (
        f"{what}: the compiled graphs issue {len(found)} collectives {sorted(found)}, "
        f"eager vma {len(log)}: {log.summary()}")


def _compiled_collectives_body(layout):
    shape, names, local_loss, in_specs = _LAYOUTS[layout]
    mesh = functp.make_mesh(shape, names)
    local = functp.shard((_params(), randn(8, 4, seed=5), randn(8, 4, seed=6)), mesh, in_specs)
    _compiled_matches_eager(functp.shard_map(local_loss, mesh, in_specs=in_specs, out_specs=P()),
                            local, layout)


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_compiled_vma_body_issues_the_eager_collectives(run, layout):
    run(4, _compiled_collectives_body, layout, timeout=600)


def _raised(info) -> list[str]:
    """The chain of exceptions behind ``info`` (Dynamo wraps the body's error)."""
    chain, e = [], info.value
    while e is not None:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return chain


def _compiled_vma_error_body():
    mesh = functp.make_mesh((2,), ("tp",))
    step = functp.shard_map(lambda w: w * 2, mesh, in_specs=P("tp"), out_specs=P())
    for fullgraph in (True, False):
        torch._dynamo.reset()
        with pytest.raises(Exception) as info, pytest.warns(UserWarning) as warned:
            torch.compile(step, fullgraph=fullgraph, backend="aot_eager")(torch.ones(2))
        error = "output varies over mesh axis 'tp' but out_specs P() says it is replicated"
        # fullgraph=False: Dynamo falls back to eager, which raises the error itself
        assert fullgraph or isinstance(info.value, functp.ShardingError), _raised(info)
        assert any(error in c for c in _raised(info)), _raised(info)
        # fullgraph=True shows only Dynamo's own message: the warning says why
        assert any(error in str(w.message) for w in warned), [str(w.message) for w in warned]


def test_compiled_vma_body_raises_the_vma_error(run):
    run(2, _compiled_vma_error_body, timeout=600)


def _compiled_closure_body():
    mesh = functp.make_mesh((2,), ("tp",))
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    step = functp.shard_map(lambda w: functp.psum((w * scale).sum(), "tp"), mesh,
                            in_specs=P("tp"), out_specs=P())
    w = randn(2, seed=1).requires_grad_()
    step(w).backward()           # eager: the closed-over tensor gets its gradient
    assert scale.grad is not None
    torch._dynamo.reset()
    with pytest.raises(Exception) as info, pytest.warns(UserWarning):
        torch.compile(step, fullgraph=True, backend="aot_eager")(w)
    assert any("requires grad but is not one of its arguments" in c
               for c in _raised(info)), _raised(info)
    # detached, it is a constant: compiled and eager agree
    const = scale.detach()
    step = functp.shard_map(lambda w: functp.psum((w * const).sum(), "tp"), mesh,
                            in_specs=P("tp"), out_specs=P())
    torch._dynamo.reset()
    eager = torch.autograd.grad(step(w), w)
    got = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager")(w), w)
    assert_tree_close(got, eager, "a closed-over constant")
    # an invariant the body makes with a keyword op (left untagged by the tracking
    # mode: untagged means invariant) is not taken for a closed-over tensor
    x = randn(3, 4, seed=2).requires_grad_()
    step = functp.shard_map(
        lambda w, x: functp.psum((x / x.mean(-1, keepdim=True) * w.sum()).sum(), "tp"),
        mesh, in_specs=(P("tp"), P()), out_specs=P())
    torch._dynamo.reset()
    eager = torch.autograd.grad(step(w, x), (w, x))
    got = torch.autograd.grad(
        torch.compile(step, fullgraph=True, backend="aot_eager")(w, x), (w, x))
    assert_tree_close(got, eager, "an invariant made with a keyword op")


def test_compiled_vma_body_refuses_a_closed_over_tensor_that_needs_a_gradient(run):
    run(2, _compiled_closure_body, timeout=600)


def _compiled_features_body():
    """functp.checkpoint, unreduced and mixed precision inside a compiled vma body
    (AOTAutograd runs their Python while it traces): the eager step's values and
    collectives."""
    shape, names, _, in_specs = _LAYOUTS["dp_tp"]
    mesh = functp.make_mesh(shape, names)
    local = functp.shard((_params(), randn(8, 4, seed=5), randn(8, 4, seed=6)), mesh, in_specs)

    def loss(p, x, y):
        return functp.pmean(functp.checkpoint(_tp_loss)(p, x, y), "dp")
    steps = {
        "checkpoint": functp.shard_map(loss, mesh, in_specs=in_specs, out_specs=P()),
        "unreduced": functp.shard_map(loss, mesh, in_specs=in_specs, out_specs=P(),
                                      unreduced="dp"),
        "mixed precision": functp.shard_map(
            _tp2d_loss, mesh, in_specs=in_specs, out_specs=P(),
            mixed_precision=functp.MixedPrecision(param_dtype=torch.float32)),
    }
    for what, step in steps.items():
        _compiled_matches_eager(step, local, what)


def test_compiled_vma_body_with_remat_unreduced_and_mixed_precision(run):
    run(4, _compiled_features_body, timeout=600)


def _compiled_non_tensor_body():
    """None and numbers as arguments, numbers as results, pass through a compiled
    vma body; a None result is refused with a reason (Dynamo takes none back)."""
    mesh = functp.make_mesh((2,), ("tp",))

    def loss(w, scale, opt):
        return functp.psum((w * scale).sum(), "tp") * (2 if opt is None else 3), 7
    step = functp.shard_map(loss, mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()))
    w = randn(4, seed=1)
    f = torch.func.grad(lambda w: step(w, 1.5, None)[0])
    torch._dynamo.reset()
    assert_tree_close(torch.compile(f, fullgraph=True, backend="aot_eager")(w), f(w),
                      "None and a number as arguments")
    torch._dynamo.reset()
    assert torch.compile(step, fullgraph=True, backend="aot_eager")(w, 1.5, None)[1] == 7
    bad = functp.shard_map(lambda w: (functp.psum(w.sum(), "tp"), None), mesh,
                           in_specs=P("tp"), out_specs=(P(), P()))
    torch._dynamo.reset()
    with pytest.raises(Exception), pytest.warns(UserWarning, match=r"output\[1\].*NoneType"):
        torch.compile(bad, fullgraph=True, backend="aot_eager")(w)


def test_compiled_vma_body_with_non_tensor_arguments_and_results(run):
    run(2, _compiled_non_tensor_body, timeout=600)


# -- inductor's collective passes on functp's collectives ------------------------------------
# functp's ops reach inductor as _c10d_functional all_reduce + wait_tensor, so its own
# passes apply: bucket_all_reduces_fx merges independent all-reduces into one.

def _bucketing_body():
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code
    mesh = functp.make_mesh((2,), ("dp",))

    def body(a, b, c):            # three independent reductions, as a hand-written DDP has
        return functp.pmean(a * 2, "dp"), functp.pmean(b.sin(), "dp"), functp.pmean(c + 1, "dp")

    f = functp.shard_map(body, mesh, in_specs=(P("dp"),) * 3, out_specs=(P(),) * 3)
    xs = [randn(2, 5, seed=i).float() for i in range(3)]
    eager = f(*xs)
    waits = {}
    for mode in ("none", "all"):
        torch._dynamo.reset()
        old = inductor_config.bucket_all_reduces_fx
        inductor_config.bucket_all_reduces_fx = mode
        try:
            got, code = run_and_get_code(torch.compile(f, fullgraph=True), *xs)
        finally:
            inductor_config.bucket_all_reduces_fx = old
        assert_tree_close(got, eager, f"bucket_all_reduces_fx={mode}")
        waits[mode] = "\n".join(code).count("_c10d_functional.wait_tensor.default(")
    return waits


def test_inductor_buckets_functp_all_reduces(run):
    for waits in run(2, _bucketing_body, timeout=600):
        assert waits == {"none": 3, "all": 1}, waits


# -- one module decides ----------------------------------------------------------------------

def test_only_functp_compile_asks_whether_torch_compile_traces():
    """What Dynamo traces, what it must not, and the refusal inside simulate are decided
    in functp/runtime/_compile.py alone (the quarantine of torch internals imports Dynamo)."""
    import pathlib
    import re
    pkg = pathlib.Path(functp.__file__).parent
    asks = re.compile(r"torch\.compiler\.|_dynamo|is_(dynamo_)?compiling|COMPILE_REFUSED")
    assert asks.search("torch.compiler.is_compiling()") and asks.search("from torch._dynamo")
    found = [f"{f.name}:{n}: {line.strip()}" for f in sorted(pkg.rglob("*.py"))
             if f.name not in ("_compile.py", "_torch_compat.py")
             for n, line in enumerate(f.read_text().splitlines(), 1)
             if asks.search(line.split("#", 1)[0])]
    assert not found, "ask functp.runtime._compile instead:\n" + "\n".join(found)


# -- a compiled function called inside an eager vma body --------------------------------------
# It runs eagerly (Dynamo would trace the tracking mode, whose tags it cannot read: it
# crashed with "'dict' object has no attribute 'node'"), so the union rule sees its ops:
# the uncompiled body's values, vma and gradients, tape and torch.func.grad alike.

def _scaled(x, w):            # w invariant, x varying: w's gradient is summed over tp
    return torch.sin(x) * w + x


def _reduced(x, w):
    return functp.psum(torch.sin(x) * w, "tp") * 2


def _compiled_in_body(lazy: bool):
    from torch._dynamo.testing import CompileCounter
    functp.set_overlap(forward=lazy)
    mesh = functp.make_mesh((2,), ("tp",))
    x, w = functp.shard(randn(4, seed=1), mesh, P("tp")), randn(1, seed=2)
    counter = CompileCounter()
    for f in (_scaled, _reduced):
        for fullgraph in (False, True):
            torch._dynamo.reset()
            cf = torch.compile(f, backend=counter, fullgraph=fullgraph)
            reduce = (lambda y: functp.psum(y, "tp")) if f is _scaled else (lambda y: y)
            want, got = (functp.shard_map(lambda x, w, g=g: reduce(g(x, w).sum()),
                                          mesh, in_specs=(P("tp"), P()), out_specs=P())
                         for g in (f, cf))
            assert_tree_close(torch.func.grad_and_value(got, argnums=(0, 1))(x, w),
                              torch.func.grad_and_value(want, argnums=(0, 1))(x, w),
                              f"{f.__name__}, fullgraph={fullgraph}: torch.func.grad")
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            assert_tree_close(torch.autograd.grad(got(xs, ws), (xs, ws)),
                              torch.autograd.grad(want(xs, ws), (xs, ws)),
                              f"{f.__name__}, fullgraph={fullgraph}: tape")
            # vma: the result varies as uncompiled (_scaled's over tp, psum's not)
            want, got = (functp.shard_map(g, mesh, in_specs=(P("tp"), P()), out_specs=P())
                         for g in (f, cf))
            if f is _scaled:
                for step in (want, got):
                    with pytest.raises(functp.ShardingError, match="varies over mesh axis 'tp'"):
                        step(x, w)
            else:
                assert_tree_close(got(x, w), want(x, w), "psum inside: vma")
    assert counter.frame_count == 0, f"compiled {counter.frame_count} frames in a vma body"
    torch.compile(_scaled, backend=counter)(x, w)      # outside a body it compiles again
    assert counter.frame_count == 1, counter.frame_count


@pytest.mark.parametrize("lazy", [True, False])
def test_compiled_function_inside_an_eager_vma_body_simulated(lazy):
    functp.simulate(_compiled_in_body, 2, lazy)


def test_compiled_function_inside_an_eager_vma_body_gloo(run):
    run(2, _compiled_in_body, True)


# -- transformers models through parallelize(model, mesh, "auto"), compiled ------------------
# Five models (Llama; Qwen3-MoE's experts; Gemma-3's tied embeddings and sliding-window
# layers; DeepSeek-V3's MLA and experts; GPT-2's shipped plan) x three ways to take the
# gradients (torch.func.grad, functp.value_and_grad, the tape) x tp=2 and dp2 x tp2,
# each torch.compile(fullgraph=True): no graph break (fullgraph raises at one), the eager
# step's gradients, the eager step's collectives (comm_log against the graphs) and no
# host sync (aten._local_scalar_dense) in any graph, which CUDA graphs
# (mode="reduce-overhead") could not replay.
#
# Cost: one cell is 2-10 s of tracing on 2 cores; the 30 cells would be ~4 minutes. What
# functp adds is decided before the backend runs (AOTAutograd runs the vma body on fake
# tensors: collectives, pvary, buffers as graph inputs), so most cells use aot_eager
# (float64 exact, 1e-10) and cover each model, mesh and path at least once between them;
# Inductor, which only lowers that same graph, compiles the representative ones (each
# path's graphs once: Llama's tape forward/backward on tp=2, its torch.func.grad and
# value_and_grad on aot_eager in the same test; Gemma-3's torch.func.grad joint graph;
# GPT-2's tape with check_vma=False), where a model's
# float32 rotary table rounds differently in Inductor's fused kernel, as the plain
# model's compiled step does (~1e-7 against eager, as the plain Llama compiled: 9e-8; GPT-2, all float64: 5e-16).
#
# The body reads the model's buffers (Llama's rotary inv_freq) from the module, not from
# its arguments: they become inputs of the compiled graph (Inductor refused them as
# real-tensor constants: "Please convert all Tensors to FakeTensors first ... inv_freq").
# MoE models compile with experts_implementation="batched_mm": transformers' "eager"
# experts loop branches on which experts got tokens, so their plain model does not
# compile with fullgraph=True either.

_FIELDS = {
    "gemma3_text": dict(tie_word_embeddings=True, sliding_window=4),
    "qwen3_moe": dict(experts_implementation="batched_mm"),
    "deepseek_v3": dict(experts_implementation="batched_mm"),
}


class _GraphCensus:
    """The collectives and host syncs (``aten._local_scalar_dense``) in every graph a
    backend compiles (forward and backward): ``backend`` is aot_eager with a census
    of its graphs, or, for ``"inductor"``, Inductor with a census pre-pass."""

    def __init__(self, backend: str):
        self.collectives, self.syncs, self.kind = [], [], backend
        if backend == "inductor":
            from torch._inductor.custom_graph_pass import CustomGraphPass
            census = self

            class Count(CustomGraphPass):
                def __call__(self, graph):
                    census.count(graph)

                def uuid(self):
                    return None                # (not cached: counted on every compile)
            self.pass_, self.backend = Count(), "inductor"
        else:
            import functools
            from torch._dynamo.backends.debugging import aot_eager, boxed_nop

            def compiler(gm, example_inputs):
                self.count(gm.graph)
                return boxed_nop(gm, example_inputs)
            self.backend = functools.partial(aot_eager, fw_compiler=compiler,
                                             bw_compiler=compiler)

    def count(self, graph) -> None:
        for n in graph.nodes:
            t = n.target
            if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
                continue
            if t.namespace == "_c10d_functional" and t._opname != "wait_tensor":
                self.collectives.append(t._opname)
            if t._opname == "_local_scalar_dense":
                self.syncs.append(str(n))

    def __enter__(self):
        if self.kind == "inductor":
            import torch._inductor.config as inductor_config
            self.old = inductor_config.post_grad_custom_pre_pass
            inductor_config.post_grad_custom_pre_pass = self.pass_
        return self

    def __exit__(self, *exc):
        if self.kind == "inductor":
            import torch._inductor.config as inductor_config
            inductor_config.post_grad_custom_pre_pass = self.old


def _steps(step, params: dict, args: tuple) -> dict:
    """The three ways to take a step's gradients: name -> f(params) -> grads."""
    names = list(params)

    def tape(s):
        def f(p):
            p = {k: v.detach().requires_grad_() for k, v in p.items()}
            return dict(zip(names, torch.autograd.grad(s(p, *args), list(p.values()))))
        return f
    return {
        "torch.func.grad": lambda c: (lambda p: c(torch.func.grad(step))(p, *args)),
        "functp.value_and_grad": lambda c: (
            lambda p: c(functp.value_and_grad(step))(p, *args)[1]),
        "tape": lambda c: tape(c(step)),
    }


def _hf_step(model_type: str, shape: tuple, names: tuple, check_vma: bool = True, **fields):
    import warnings
    import _hf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # transformers' notes about tiny configs
        model = _hf._build(model_type, **{**_FIELDS.get(model_type, {}), **fields})
    mesh = functp.make_mesh(shape, names)
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    dp = "dp" if "dp" in names else None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, _hf.VOCAB, (_hf.BATCH, _hf.SEQ), generator=g)
    tgt = torch.randint(_hf.VOCAB, (_hf.BATCH, _hf.SEQ), generator=g)

    def local_loss(p, i, t):
        loss = _hf._lm_loss(apply(p, input_ids=i, use_cache=False).logits, t)
        return functp.pmean(loss, dp) if dp else loss
    step = functp.shard_map(local_loss, mesh, in_specs=(specs, P(dp), P(dp)),
                            out_specs=P(), check_vma=check_vma)
    return step, params, functp.shard((ids, tgt), mesh, P(dp))


def _compiled_hf_body(model_type: str, shape: tuple, names: tuple, paths: tuple,
                      backend: str = "inductor", check_vma: bool = True,
                      fields: dict | None = None, aot_eager_paths: tuple = ()):
    """``paths`` compiled with ``backend``, and ``aot_eager_paths`` (also in ``paths``)
    with aot_eager: the same model and step, built once. Inductor compiles rank 0's
    graphs only, rank 1 runs the same graphs on aot_eager: the ranks' programs are one
    program (SPMD), so a second Inductor compile would lower the same graphs again
    (~7 CPU-s of the Llama test's 41 with an empty Inductor cache), while rank 0's
    compiled collectives still pair with a peer's and its values flow into rank 1's
    (which is then held to Inductor's tolerance too)."""
    import torch._dynamo
    step, params, args = _hf_step(model_type, shape, names, check_vma, **(fields or {}))
    for path, make in _steps(step, params, args).items():
        if path not in paths:
            continue
        backend_ = "aot_eager" if path in aot_eager_paths else backend
        if backend_ == "inductor" and torch.distributed.get_rank() != 0:
            backend_ = "aot_eager"
        with functp.comm_log() as log:
            eager = make(lambda f: f)(params)
        torch._dynamo.reset()
        with _GraphCensus(backend_) as census:
            got = make(lambda f: torch.compile(f, fullgraph=True, backend=census.backend))(
                params)
        what = f"{model_type} {names} {path} {backend_} check_vma={check_vma}"
        scale = max(v.abs().max().item() for v in eager.values())
        worst = max((got[k] - eager[k]).abs().max().item() for k in eager) / scale
        # (Inductor: the models' float32 rotary tables, see above)
        exact = backend != "inductor" or path in aot_eager_paths or model_type == "gpt2"
        assert worst < (1e-10 if exact else 1e-6), f"{what}: {worst:.2e}"
        assert not census.syncs, f"{what}: host syncs in the compiled graphs {census.syncs}"
        assert len(census.collectives) == len(log), (
            f"{what}: the compiled graphs issue {sorted(census.collectives)}, the eager "
            f"step {log.summary()}")


_ONE = dict(num_hidden_layers=1)     # (a layer of each kind is enough: half the tracing)


def test_inductor_compiles_a_transformers_llama_through_parallelize_tp2(run):
    # Inductor: the tape's forward and backward graphs, what most scripts compile.
    # torch.func.grad's one joint graph goes through Inductor in the Gemma-3 test below
    # (the same rotary, attention and MLP lowerings); here aot_eager checks it and
    # functp.value_and_grad (that graph with the loss as one more output): their
    # collectives, no host sync, exact gradients. (Inductor on all three: 108 s of the
    # suite, a second Inductor path 12-16 s of it alone with a cold cache)
    pytest.importorskip("transformers")
    run(2, _compiled_hf_body, "llama", (2,), ("tp",),
        ("torch.func.grad", "functp.value_and_grad", "tape"), "inductor", True, _ONE,
        ("torch.func.grad", "functp.value_and_grad"), timeout=900)


def test_inductor_compiles_a_check_vma_false_body_of_gpt2(run):
    pytest.importorskip("transformers")
    run(2, _compiled_hf_body, "gpt2", (2,), ("tp",), ("tape",), "inductor", False, _ONE,
        timeout=900)


def test_inductor_compiles_a_tied_sliding_window_gemma3_through_parallelize_tp2(run):
    # one layer: with sliding_window=4 the tiny config's two layers are both
    # "sliding_attention" (Gemma-3 has a full-attention layer every sixth), so a second
    # one compiled the same layer again
    pytest.importorskip("transformers")
    run(2, _compiled_hf_body, "gemma3_text", (2,), ("tp",), ("torch.func.grad",), "inductor",
        True, _ONE, timeout=900)


_TP2, _DP2_TP2 = ((2,), ("tp",)), ((2, 2), ("dp", "tp"))
_GRAD, _VAG, _TAPE = "torch.func.grad", "functp.value_and_grad", "tape"
# (model, mesh, paths, fields): with the Inductor tests above, every model on both
# meshes and every path on each mesh; 2-10 s a cell
_AOT_CELLS = [
    ("qwen3_moe", _TP2, (_TAPE,), _ONE),
    ("qwen3_moe", _DP2_TP2, (_GRAD,), _ONE),
    ("deepseek_v3", _TP2, (_VAG,), {}),          # (layer 0 dense, layer 1 MoE)
    ("deepseek_v3", _DP2_TP2, (_TAPE,), _ONE),   # (MLA and a dense MLP)
    ("gemma3_text", _DP2_TP2, (_VAG,), _ONE),    # (its one layer: sliding window)
    ("llama", _DP2_TP2, (_GRAD, _TAPE), _ONE),
    ("gpt2", _TP2, (_GRAD, _VAG), _ONE),
    ("gpt2", _DP2_TP2, (_TAPE,), _ONE),
]


@pytest.mark.parametrize("model_type,mesh,paths,fields", _AOT_CELLS, ids=[
    f"{m}-{'x'.join(n)}-{'+'.join(p)}" for m, (_, n), p, _ in _AOT_CELLS])
def test_compiled_transformers_step_matches_eager(run, model_type, mesh, paths, fields):
    pytest.importorskip("transformers")
    shape, names = mesh
    run(math.prod(shape), _compiled_hf_body, model_type, shape, names, paths, "aot_eager",
        True, fields, timeout=900)


def _eager_experts_body():
    """transformers' "eager" experts loop reads which experts got tokens: compiled, the
    warning names the cause and the implementation that compiles."""
    import torch._dynamo
    step, params, args = _hf_step("qwen3_moe", (2,), ("tp",), experts_implementation="eager",
                                  num_hidden_layers=1)
    torch._dynamo.reset()
    with pytest.raises(Exception), pytest.warns(UserWarning) as warned:
        torch.compile(torch.func.grad(step), fullgraph=True, backend="aot_eager")(params, *args)
    text = " ".join(str(w.message) for w in warned)
    assert "experts_implementation='batched_mm'" in text, text


def test_compiled_eager_experts_loop_says_what_compiles(run):
    pytest.importorskip("transformers")
    run(2, _eager_experts_body, timeout=900)
