"""vma semantics: errors for outputs declared replicated that vary and for sums of
invariant values, in-place ops, custom autograd Functions, grad inside the body, and
a randomized property test (vma == check_vma=False == the unsharded oracle)."""
from __future__ import annotations

import math
import random

import pytest
import torch

import functp
from functp import P, ShardingError
from _oracle import assert_tree_close, check_program, randn


def _raises(fn, *words):
    with pytest.raises(ShardingError) as info:
        fn()
    for w in words:
        assert w in str(info.value), f"{w!r} not in: {info.value}"


def _error_body():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    x = torch.ones(4, 2)
    sm = lambda f, i, o: functp.shard_map(f, mesh, in_specs=i, out_specs=o)
    _raises(lambda: sm(lambda x: x * 2, P("dp"), P())(x),
            "output varies over mesh axis 'dp'", "out_specs P()", "replicated over 'dp'",
            "functp.psum/pmean(..., 'dp')", "mention 'dp' in out_specs")
    _raises(lambda: sm(lambda x: {"loss": x.sum()}, P(None, "tp"), {"loss": P()})(x),
            "output['loss'] varies over mesh axis 'tp'")
    _raises(lambda: sm(lambda x: functp.psum(x, "dp"), P(), P())(x),
            "functp.psum over ('dp',)", "(4, 2)", "invariant over mesh axis 'dp'",
            "functp.axis_size('dp')", "functp.pvary(x, 'dp')")
    _raises(lambda: sm(lambda x: functp.psum(x, ("dp", "tp")), P("tp"), P())(x),
            "invariant over mesh axis 'dp'")
    _raises(lambda: sm(lambda x: functp.psum_scatter(x, "tp", tiled=True), P(), P("tp"))(x),
            "psum_scatter", "invariant")
    # a varying value may be declared split over an axis it is invariant over: x + 1
    # varies over dp (an out_spec replicated over dp is refused) and over nothing else
    # (P("dp") takes it); every tp rank's block is the same x + 1
    block = lambda d: torch.arange(8.).reshape(4, 2) + 100 * d      # rank dp=d's x
    xd = block(mesh.coordinate["dp"])
    _raises(lambda: sm(lambda x: x + 1, P("dp"), P(None, "tp"))(xd),
            "output varies over mesh axis 'dp'", "replicated over 'dp'")
    assert torch.equal(sm(lambda x: x + 1, P("dp"), P("dp"))(xd), xd + 1)
    out = sm(lambda x: x + 1, P("dp"), P("dp", "tp"))(xd)
    assert torch.equal(out, xd + 1), out
    full = functp.unshard(out, mesh, P("dp", "tp"))
    want = torch.cat([(block(d) + 1).repeat(1, 2) for d in range(2)])
    assert torch.equal(full, want), (full, want)
    # the explicit form of "sum of copies" is allowed and means it
    w = torch.full((3,), 2.0, dtype=torch.float64)
    f = sm(lambda w: functp.psum(functp.pvary(w, "dp"), "dp").sum(), P(), P())
    grad, val = torch.func.grad_and_value(f)(w)
    assert val.item() == 12.0 and grad.tolist() == [2.0, 2.0, 2.0]


def test_vma_errors_and_explicit_pvary(run):
    run(4, _error_body)


def _inplace_body(check_vma):
    mesh = functp.make_mesh((4,), ("dp",))

    def glob(w, x):                     # mean over the 4 ranks' row blocks
        total = 0
        for xb in x.view(4, 2, 3):
            h = w * 1.0
            h = h + xb
            h = torch.cat([h[:1], h[1:] * w[1:]])
            total = total + (h ** 2).sum() / 4
        return total

    def local(w, x):
        h = w * 1.0            # invariant
        h += x                 # mutated by a varying value: implicit in-place pvary
        h[1:] *= w[1:]         # in place on a view, invariant operand
        return functp.pmean((h ** 2).sum(), "dp")
    check_program(mesh, glob, local, (randn(2, 3, seed=1), randn(8, 3, seed=2)),
                  (P(), P("dp")), check_vma=check_vma)

    def local_view(w, x):
        buf = torch.zeros(2, 3, dtype=x.dtype)      # fresh: invariant
        buf[0] = w[0]
        buf[1:] = x[1:] * w[1:]                     # a view of buf becomes varying
        return functp.pmean((buf ** 2).sum(), "dp")

    def glob_view(w, x):
        return sum((torch.cat([w[:1], xb[1:] * w[1:]]) ** 2).sum() / 4 for xb in x.view(4, 2, 3))
    check_program(mesh, glob_view, local_view, (randn(2, 3, seed=1), randn(8, 3, seed=2)),
                  (P(), P("dp")), check_vma=check_vma)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_inplace_ops(run, check_vma):
    run(4, _inplace_body, check_vma)


class _ScaledTanh(torch.autograd.Function):
    """A user's custom Function mixing an invariant and a varying input."""

    @staticmethod
    def forward(x, w):
        return torch.tanh(x * w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, output)

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        d = g * (1 - y ** 2)
        return d * w, (d * x).sum(0)


def _custom_function_body(check_vma):
    mesh = functp.make_mesh((2,), ("dp",))
    check_program(mesh, lambda x, w: (_ScaledTanh.apply(x, w) ** 2).sum(),
                  lambda x, w: functp.psum((_ScaledTanh.apply(x, w) ** 2).sum(), "dp"),
                  (randn(4, 3, seed=1), randn(3, seed=2)), (P("dp"), P()), check_vma=check_vma)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_custom_autograd_function_follows_the_union_rule(run, check_vma):
    run(2, _custom_function_body, check_vma)


def _grad_inside_body():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    specs = {"w1": P("tp", None), "w2": P(None, "tp"), "b": P()}
    p = {"w1": randn(4, 3, seed=1), "w2": randn(3, 4, seed=2), "b": randn(3, seed=3)}
    x = randn(8, 3, seed=4)

    def glob(p, x):
        return ((torch.tanh(x @ p["w1"].T) @ p["w2"].T + p["b"]) ** 2).mean()

    def local(p, x):
        out = functp.psum(torch.tanh(x @ p["w1"].T) @ p["w2"].T, "tp") + p["b"]
        return functp.pmean((out ** 2).mean(), "dp")
    # the gradient taken inside the body is already summed over the axes each
    # parameter was implicitly pvary'd over: JAX's answer
    f = functp.shard_map(torch.func.grad(local), mesh, in_specs=(specs, P("dp")), out_specs=specs)
    got = f(functp.shard(p, mesh, specs), functp.shard(x, mesh, P("dp")))
    assert_tree_close(functp.unshard(got, mesh, specs), torch.func.grad(glob)(p, x), "grad in body")


def test_grad_inside_the_body_is_summed_like_jax(run):
    run(4, _grad_inside_body)


# ---------------------------------------------------------------------------------
# randomized programs: matrices whose rows are split over an axis tuple (or not)


class _Prog:
    """A random straight-line program, interpreted twice: globally (full tensors on
    one process) and locally (blocks plus collectives)."""

    def __init__(self, rng: random.Random, mesh_axes: tuple[str, ...], sizes: dict):
        self.rng, self.sizes = rng, sizes
        layouts = [()] + [(a,) for a in mesh_axes] + ([tuple(mesh_axes)] if len(mesh_axes) > 1 else [])
        self.inputs = []       # (shape, rows-split axes)
        self.ops = []
        n_in = rng.randint(2, 4)
        for _ in range(n_in):
            self.inputs.append(((8, 3), rng.choice(layouts)))
        self.inputs.append(((3, 3), ()))          # a replicated weight
        self.inputs.append(((1, 3), ()))          # a replicated row vector
        # value table: (layout, varying axes) for each value id
        vals = [(lay, frozenset(lay)) for _, lay in self.inputs[:n_in]]
        vals += [((), frozenset()), ((), frozenset())]
        rows = [i for i in range(n_in)]
        for _ in range(rng.randint(4, 9)):
            kind = rng.choice(["unary", "binary", "matmul", "rowvec", "ppermute", "gather", "rowsum"])
            i = rng.choice(rows)
            lay, vma = vals[i]
            if kind == "unary":
                self.ops.append(("unary", i, rng.choice(["sin", "tanh", "square"])))
                vals.append((lay, vma))
            elif kind == "binary":
                same = [j for j in rows if vals[j][0] == lay]
                j = rng.choice(same)
                self.ops.append(("binary", i, j, rng.choice(["add", "mul"])))
                vals.append((lay, vma | vals[j][1]))
            elif kind == "matmul":
                self.ops.append(("matmul", i, n_in))
                vals.append((lay, vma))
            elif kind == "rowvec":
                self.ops.append(("rowvec", i, n_in + 1))
                vals.append((lay, vma))
            elif kind == "ppermute" and lay:
                self.ops.append(("ppermute", i, lay))
                vals.append((lay, vma))
            elif kind == "gather" and lay:
                inv = rng.random() < 0.5
                self.ops.append(("gather", i, lay, inv))
                vals.append(((), (vma - frozenset(lay)) if inv else vma))
            elif kind == "rowsum" and lay:
                self.ops.append(("rowsum", i, lay))       # -> (1, 3) replicated over lay
                vals.append(("rowsum", vma - frozenset(lay)))
                continue
            else:
                continue
            rows.append(len(vals) - 1)
        self.vals = vals
        # the loss reads every input (so each has a gradient) and the last values
        self.final = sorted(set(range(len(self.inputs))) | set(range(len(vals))[-3:]))

    def global_fn(self, *xs):
        env = list(xs)
        for op in self.ops:
            env.append(self._global_op(env, op))
        return sum((env[i] ** 2).sum() for i in self.final)

    def _global_op(self, env, op):
        kind = op[0]
        if kind == "unary":
            return _unary(op[2], env[op[1]])
        if kind == "binary":
            return env[op[1]] + env[op[2]] if op[3] == "add" else env[op[1]] * env[op[2]]
        if kind == "matmul":
            return env[op[1]] @ env[op[2]]
        if kind == "rowvec":
            return env[op[1]] + env[op[2]]
        if kind == "ppermute":
            n = math.prod(self.sizes[a] for a in op[2])
            return torch.roll(env[op[1]], 8 // n, 0)
        if kind == "gather":
            return env[op[1]]
        if kind == "rowsum":
            return env[op[1]].sum(0, keepdim=True)

    def local_fn(self, *xs):
        env = list(xs)
        for op in self.ops:
            env.append(self._local_op(env, op))
        total = 0
        for i in self.final:
            lay, vma = self.vals[i]
            part = (env[i] ** 2).sum()
            if lay and lay != "rowsum":
                part = functp.psum(part, lay)
                vma = vma - frozenset(lay)
            total = total + part
        leftover = frozenset().union(*[self.vals[i][1] - frozenset(
            self.vals[i][0] if self.vals[i][0] not in ((), "rowsum") else ()) for i in self.final])
        return functp.pmean(total, tuple(sorted(leftover))) if leftover else total

    def _local_op(self, env, op):
        kind = op[0]
        if kind == "ppermute":
            n = math.prod(self.sizes[a] for a in op[2])
            return functp.ppermute(env[op[1]], op[2], [(k, (k + 1) % n) for k in range(n)])
        if kind == "gather":
            fn = functp.all_gather_invariant if op[3] else functp.all_gather
            return fn(env[op[1]], op[2], tiled=True)
        if kind == "rowsum":
            return functp.psum(env[op[1]].sum(0, keepdim=True), op[2])
        return self._global_op(env, op)

    def specs(self):
        return tuple(P(lay if len(lay) != 1 else lay[0]) if lay else P() for _, lay in self.inputs)

    def args(self, seed):
        return tuple(randn(*shape, seed=seed + k) for k, (shape, _) in enumerate(self.inputs))


def _unary(name, x):
    return {"sin": torch.sin, "tanh": torch.tanh, "square": torch.square}[name](x)


def _property_body(shape, names, seed, count):
    mesh = functp.make_mesh(shape, names)
    rng = random.Random(seed)
    for k in range(count):
        prog = _Prog(rng, names, mesh.shape)
        args = prog.args(seed * 100 + k)
        for check_vma in (True, False):
            try:
                check_program(mesh, prog.global_fn, prog.local_fn, args, prog.specs(),
                              check_vma=check_vma)
            except Exception as e:
                raise AssertionError(f"program {k} (check_vma={check_vma}): {prog.inputs} "
                                     f"{prog.ops}") from e


@pytest.mark.parametrize("shape,names,seed", [((4,), ("x",), 1), ((2,), ("x",), 2),
                                              ((2, 2), ("a", "b"), 3), ((2, 4), ("a", "b"), 4)])
def test_random_programs_vma_equals_sum_semantics_equals_oracle(run, shape, names, seed):
    run(math.prod(shape), _property_body, shape, names, seed, 12)


# ---------------------------------------------------------------------------------
# nested shard_map: an outer body manual over 'dp' calls an inner one over 'tp'

def _nested_body(check_vma):
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    specs = {"w1": P("tp", None), "b1": P("tp"), "w2": P(None, "tp"), "b2": P()}
    p = {"w1": randn(8, 4, seed=1), "b1": randn(8, seed=2), "w2": randn(4, 8, seed=3),
         "b2": randn(4, seed=4)}
    x, y = randn(6, 4, seed=5), randn(6, 4, seed=6)

    def glob(p, x, y):
        return ((torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"] - y) ** 2).mean()

    def mlp(p, x):          # manual over tp: this rank's hidden units
        return functp.psum(torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T, "tp") + p["b2"]

    inner = functp.shard_map(mlp, mesh, in_specs=(specs, P()), out_specs=P(),
                             axis_names={"tp"}, check_vma=check_vma)

    def outer(p, x, y):     # manual over dp: whole parameters, this rank's rows
        assert p["w1"].shape == (8, 4)
        with pytest.raises(ShardingError, match="not manual"):
            functp.psum(x, "tp")
        return functp.pmean(((inner(p, x) - y) ** 2).mean(), "dp")

    def run_outer(p, x, y):
        return functp.shard_map(outer, mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P(),
                                axis_names={"dp"}, check_vma=check_vma)(p, x, y)
    # the parameters enter whole (P() over dp; tp is not manual in the outer body)
    g, loss = torch.func.grad_and_value(run_outer)(p, *functp.shard((x, y), mesh, P("dp")))
    ref_g, ref = torch.func.grad_and_value(glob)(p, x, y)
    assert_tree_close((loss, g), (ref, ref_g), "nested shard_map")
    with pytest.raises(ShardingError, match="already manual"):
        functp.shard_map(lambda x: inner(p, x), mesh, in_specs=P(), out_specs=P())(x)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_nested_shard_map_over_the_remaining_axis(run, check_vma):
    run(4, _nested_body, check_vma)


def _no_tag_left_body():
    mesh = functp.make_mesh((2,), ("dp",))
    w, x = randn(3, seed=1), randn(4, 3, seed=2)
    f = functp.shard_map(lambda w, x: functp.psum((x * w).sum(), "dp"), mesh,
                         in_specs=(P(), P("dp")), out_specs=P())
    torch.func.grad(f)(w, x)
    f(w, x)
    assert not [k for k in (*w.__dict__, *x.__dict__) if "functp" in k]


def test_tracking_leaves_no_attribute_on_the_inputs(run):
    run(2, _no_tag_left_body)


def _identity_body():
    mesh = functp.make_mesh((2,), ("dp",))
    x = randn(4, 3, seed=1)
    ident = functp.shard_map(lambda x: x, mesh, in_specs=P("dp"), out_specs=P("dp"))
    g = torch.func.grad(lambda x: (ident(x) * x).sum())(x)
    assert torch.equal(g, 2 * x)                     # no extra psum on the way back
    with pytest.raises(ShardingError, match="varies over mesh axis 'dp'"):
        functp.shard_map(lambda x: x, mesh, in_specs=P("dp"), out_specs=P())(x)


def test_an_input_returned_as_is_keeps_its_vma(run):
    run(2, _identity_body)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _views_of_inputs_body():
    mesh = functp.make_mesh((2,), ("dp",))
    w = randn(4, 6, seed=1)
    x = functp.shard(randn(8, 6, seed=2), mesh, P("dp"))

    def loss(w, x):        # views of a replicated input meet dp-varying data
        return functp.pmean((x @ w.T).sum() + (x[:, 1:] * w[0, 1:]).sum()
                            + (x @ w.view(6, 4)).sum(), "dp")
    step = functp.shard_map(loss, mesh, in_specs=(P(), P("dp")), out_specs=P())
    ref = torch.func.grad(lambda w, x: (x @ w.T).sum() + (x[:, 1:] * w[0, 1:]).sum()
                          + (x @ w.view(6, 4)).sum())(w, functp.unshard(x, mesh, P("dp")))
    wt = w.clone().requires_grad_()
    with _Ops() as ops:
        g, = torch.autograd.grad(step(wt, x), [wt])
    assert_tree_close(g, ref / 2, "views of an input")       # the gradient of the mean
    assert_tree_close(torch.func.grad(step)(w, x), ref / 2, "views of an input, grad")
    # the views are made again on the input's alias, so their backward is theirs:
    # no as_strided (whose backward fills a zero tensor the size of w, then copies)
    assert not [n for n in ops.names if "as_strided" in n], ops.names


def test_views_of_an_input_use_its_alias_viewed_the_same_way(run):
    run(2, _views_of_inputs_body)
