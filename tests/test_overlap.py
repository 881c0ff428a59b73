"""Gradient collectives in flight during the backward (functp/ops/_overlap.py).

The gradient all-reduces of replicated parameters are launched in buckets as soon as
their gradients are complete and waited on at the end of the body's backward; an
FSDP gather's reduce-scatter likewise. The gradients equal the unsharded float64
program's (tape autograd, torch.func.grad, functp.value_and_grad; 2 and 4 ranks, 1-d
and 2-d meshes); the order of events shows the backward computing while a bucket is
in flight (no timing); a failed bucket names its collective.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import functp
import functp.ops._primitives as prim
from functp import P
from _oracle import assert_tree_close, randn

D, LAYERS, B = 8, 4, 8
WEIGHT_MB = D * D * 8 / 2**20      # one float64 weight's MiB


@contextlib.contextmanager
def overlap(**settings):
    prev = functp.set_overlap(**settings)
    try:
        yield
    finally:
        functp.set_overlap(**prev)


def _params():
    return {f"w{i}": randn(D, D, seed=i) for i in range(LAYERS)}


def _forward(p, x, mark=None):
    h = x
    for i in range(LAYERS):
        h = torch.tanh(h @ p[f"w{i}"])
        if mark is not None:
            h = mark(h, i)
    return h


def _global_loss(p, x):
    return _forward(p, x).square().mean()


def _dp_step(mesh, how, p, x, mark=None):
    axes = mesh.axis_names
    step = functp.shard_map(lambda p, x: functp.pmean(_forward(p, x, mark).square().mean(), axes),
                            mesh, in_specs=(P(), P(axes)), out_specs=P())
    if how == "tape":
        p = {k: v.clone().requires_grad_() for k, v in p.items()}
        loss = step(p, x)
        loss.backward()
        return loss.detach(), {k: v.grad for k, v in p.items()}
    if how == "forward":
        return step(p, x)
    if how == "func_grad":
        g, loss = torch.func.grad_and_value(step)(p, x)
        return loss, g
    return functp.value_and_grad(step)(p, x)


def _dp_body(shape, how, bucket_mb):
    mesh = functp.make_mesh(shape, ("dp", "tp")[:len(shape)])
    p, x = _params(), randn(B * mesh.size, D, seed=9)
    ref_g, ref_loss = torch.func.grad_and_value(_global_loss)(p, x)
    local_x = functp.shard(x, mesh, P(mesh.axis_names))
    with overlap(first_bucket_mb=bucket_mb, bucket_mb=bucket_mb), functp.comm_log() as log:
        loss, g = _dp_step(mesh, how, p, local_x)
    assert_tree_close(loss, ref_loss, "loss")
    assert_tree_close(g, ref_g, "grads")
    return log.count("all_reduce")


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
@pytest.mark.parametrize("how", ["tape", "func_grad", "value_and_grad"])
def test_dp_step_gradients_in_buckets(run, shape, how):
    # buckets of one weight: the pmean, then one all-reduce per layer's gradient
    n = 1
    for s in shape:
        n *= s
    counts = run(n, _dp_body, shape, how, WEIGHT_MB)
    assert counts == [1 + LAYERS] * n, counts
    # the default buckets (1 MiB, then 25) hold the whole model: one gradient all-reduce
    assert run(n, _dp_body, shape, how, 25.0) == [2] * n


def _min_buckets_body(how, k):
    mesh = functp.make_mesh((2,), ("dp",))
    p, x = _params(), randn(B * 2, D, seed=9)
    ref_g, ref_loss = torch.func.grad_and_value(_global_loss)(p, x)
    with overlap(first_bucket_mb=WEIGHT_MB, bucket_mb=25.0, min_buckets=k), \
            functp.comm_log() as log:
        loss, g = _dp_step(mesh, how, p, functp.shard(x, mesh, P("dp")))
    assert_tree_close(loss, ref_loss, "loss")
    assert_tree_close(g, ref_g, "grads")
    return log.count("all_reduce")


@pytest.mark.parametrize("how", ["tape", "func_grad"])
def test_a_small_models_gradients_make_min_buckets(run, how):
    # bucket_mb (25 MiB) caps a bucket; where a dtype's gradients would make fewer than
    # min_buckets, they are cut smaller (not below first_bucket_mb): the pmean, the
    # first weight's bucket, then the other three weights in 1, 2 or 3 buckets
    assert run(2, _min_buckets_body, how, 1) == [3, 3]
    assert run(2, _min_buckets_body, how, 2) == [4, 4]
    assert run(2, _min_buckets_body, how, LAYERS) == [1 + LAYERS] * 2


def test_the_default_bucket_size_follows_the_gradients_size():
    from functp.ops._buckets import bucket_bytes
    cfg, mib = functp.set_overlap(), 2**20
    assert (cfg["bucket_mb"], cfg["first_bucket_mb"], cfg["min_buckets"]) == (25.0, 1.0, 8)
    assert bucket_bytes(32 * mib, cfg) == 4 * mib       # benchmarks/overlap.py's model
    assert bucket_bytes(4 * 2**30, cfg) == 25 * mib     # a large model's: DDP's
    assert bucket_bytes(2 * mib, cfg) == 1 * mib        # not below the first bucket
    assert bucket_bytes(32 * mib, dict(cfg, min_buckets=1)) == 25 * mib


def _nested_body(kind):
    mesh = functp.make_mesh((2,), ("dp",))
    p, x = _params(), randn(2 * B, D, seed=9)
    step = functp.shard_map(lambda p, x: functp.pmean(_forward(p, x).square().mean(), "dp"),
                            mesh, in_specs=(P(), P("dp")), out_specs=P())
    glob = _global_loss
    local_x = functp.shard(x, mesh, P("dp"))
    with overlap(first_bucket_mb=WEIGHT_MB, bucket_mb=WEIGHT_MB):
        if kind == "grad_of_grad":     # a differentiated backward waits at once
            hvp = lambda f, xx: torch.func.grad(lambda q: torch.func.grad(f)(q, xx)["w0"].sum())(p)
            assert_tree_close(hvp(step, local_x), hvp(glob, x), "grad of grad")
        elif kind == "create_graph":
            q = {k: v.clone().requires_grad_() for k, v in p.items()}
            gs = torch.autograd.grad(step(q, local_x), list(q.values()), create_graph=True)
            qq = {k: v.clone().requires_grad_() for k, v in p.items()}
            want = torch.autograd.grad(glob(qq, x), list(qq.values()), create_graph=True)
            assert_tree_close(list(gs), list(want), "create_graph grads")
            got = torch.autograd.grad(gs[0].sum(), list(q.values()))
            ref = torch.autograd.grad(want[0].sum(), list(qq.values()))
            assert_tree_close(list(got), list(ref), "second derivative")
        else:                           # vmap of grad: per-chunk gradients
            xs = local_x.unflatten(0, (2, -1))
            per_chunk = torch.func.vmap(torch.func.grad(step), (None, 0))
            got = per_chunk(p, xs)
            with overlap(enabled=False):
                assert_tree_close(got, per_chunk(p, xs), "vmap of grad")
            # chunk c of every rank makes a global batch; the oracle's gradient on it
            full = x.unflatten(0, (2, 2, -1))
            for c in range(2):
                want = torch.func.grad(glob)(p, full[:, c].flatten(0, 1))
                assert_tree_close({k: v[c] for k, v in got.items()}, want, f"chunk {c}")


@pytest.mark.parametrize("kind", ["grad_of_grad", "create_graph", "vmap_of_grad"])
def test_nested_transforms_unchanged(run, kind):
    run(2, _nested_body, kind)


def _fsdp_body(how):
    mesh = functp.make_mesh((2,), ("dp",))
    p, x = _params(), randn(2 * B, D, seed=9)
    ref_g, ref_loss = torch.func.grad_and_value(_global_loss)(p, x)

    def loss(p, x):
        full = {k: functp.all_gather(v, "dp", tiled=True) for k, v in p.items()}
        return functp.pmean(_forward(full, x).square().mean(), "dp")

    step = functp.shard_map(loss, mesh, in_specs=(P("dp"), P("dp")), out_specs=P())
    lp, lx = functp.shard(p, mesh, P("dp")), functp.shard(x, mesh, P("dp"))
    with functp.comm_log() as log:
        if how == "tape":
            lp = {k: v.clone().requires_grad_() for k, v in lp.items()}
            step(lp, lx).backward()
            g = {k: v.grad for k, v in lp.items()}
        else:
            g = torch.func.grad(step)(lp, lx)
    assert_tree_close(functp.unshard(g, mesh, P("dp")), ref_g, "fsdp grads")
    return log.count("reduce_scatter")


@pytest.mark.parametrize("how", ["tape", "func_grad"])
def test_fsdp_gradients(run, how):
    assert run(2, _fsdp_body, how) == [LAYERS] * 2


# -- the order of events: the backward computes while a bucket is in flight --------------

def _marked(events):
    """Identity on layer ``i``'s output; records when the backward reaches it."""
    def mark(h, i):
        h.register_hook(lambda ct: events.append((functp.process_index(), "backward", i)))
        return h
    return mark


def _ordered_body(events, how, enabled, per=1):
    """A dp step with buckets of ``per`` weights; with ``per`` > 1, the second step (its
    buckets cut at the entry, in the order the first one's gradients came in)."""
    mesh = functp.make_mesh((2,), ("dp",))
    p, x = _params(), randn(2 * B, D, seed=9)
    local_x = functp.shard(x, mesh, P("dp"))
    mark = _marked(events)
    with overlap(enabled=enabled, first_bucket_mb=per * WEIGHT_MB, bucket_mb=per * WEIGHT_MB):
        if per > 1:
            _dp_step(mesh, how, p, local_x)
            events.append((functp.process_index(), "second", None))
        _, g = _dp_step(mesh, how, p, local_x, mark)
    return g


def _fsdp_ordered_body(events, how, enabled):
    mesh = functp.make_mesh((2,), ("dp",))
    p, x = _params(), randn(2 * B, D, seed=9)
    mark = _marked(events)

    def loss(p, x):        # each layer's weight gathered right before the layer runs
        h = x
        for i in range(LAYERS):
            h = mark(torch.tanh(h @ functp.all_gather(p[f"w{i}"], "dp", tiled=True)), i)
        return functp.pmean(h.square().mean(), "dp")

    step = functp.shard_map(loss, mesh, in_specs=(P("dp"), P("dp")), out_specs=P())
    with overlap(enabled=enabled, first_bucket_mb=WEIGHT_MB / 2):
        torch.func.grad(step)(functp.shard(p, mesh, P("dp")), functp.shard(x, mesh, P("dp")))


def _order(monkeypatch, how, enabled, body=_ordered_body, op="all_reduce", *args):
    """The events of a 2-rank step, in the order they happened: (rank, what, which);
    "launch" and "wait" are those of ``op`` on a weight-sized tensor or larger.
    Simulated ranks take turns and hand over only where one waits, so a collective a
    rank launched cannot finish before the other rank has launched it too."""
    events: list = []
    record, wait = prim._record, prim._wait

    def launched(o, g, x, how="", ragged=False):
        if o == op and x.numel() >= D * D:      # a gradient bucket / reduce-scatter
            events.append((functp.process_index(), "launch", None))
        return record(o, g, x, how, ragged)

    def waited(t, o, g):
        if o.startswith(op) and t.numel() >= D * D // 2:
            events.append((functp.process_index(), "wait", None))
        return wait(t, o, g)

    monkeypatch.setattr(prim, "_record", launched)
    monkeypatch.setattr(prim, "_wait", waited)
    functp.simulate(body, 2, events, how, enabled, *args, check=False)
    return [(r, what) if what != "backward" else (r, what, i) for r, what, i in events]


@pytest.mark.parametrize("how", ["tape", "func_grad"])
def test_a_later_steps_bucket_launches_once_its_weights_gradients_are_in(monkeypatch, how):
    # buckets of two weights, cut at the entry after the first step: each launch point
    # made at the first use of its weights (made at the entry, its node waited for the
    # whole backward: the engine runs ready nodes latest-made first)
    ev = _order(monkeypatch, how, True, _ordered_body, "all_reduce", 2)
    second = {q: ev.index((q, "second")) for q in (0, 1)}

    def at(e):          # (the second step's: after the rank's mark)
        return ev.index(e, second[e[0]])
    r = min((0, 1), key=lambda q: at((q, "launch")))     # whichever rank ran first
    first = at((r, "launch"))                 # the last two layers' bucket
    assert ev[second[r]:].count((r, "launch")) == LAYERS // 2, ev
    assert at((r, "backward", LAYERS - 2)) < first < at((r, "backward", 0)), ev
    assert at((r, "backward", 0)) < at((1 - r, "launch")), ev     # peer not yet in


def _planned_body(events, how, enabled):
    """Three dp steps of a parallelized stack of Linear layers (a plan dict; tp of
    size 1), buckets of one weight: the first step decides vma per op, the later
    ones replay it. Each step's gradients against the unsharded model's."""
    mesh = functp.make_mesh((2, 1), ("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(LAYERS)]).double()
    ref_model = copy.deepcopy(model)
    apply, params, specs = functp.parallelize(
        model, mesh, {str(i): ("colwise", "rowwise")[i % 2] for i in range(LAYERS)})
    mark = _marked(events)
    for i, layer in enumerate(apply.module):
        layer.register_forward_hook(lambda m, a, out, i=i: mark(out, i))
    x = randn(2 * B, D, seed=9)
    step = functp.shard_map(lambda p, x: functp.pmean(apply(p, x).square().mean(), "dp"),
                            mesh, in_specs=(specs, P("dp")), out_specs=P())
    ref = torch.func.grad(lambda q: torch.func.functional_call(ref_model, q, (x,))
                          .square().mean())(dict(ref_model.named_parameters()))
    with overlap(enabled=enabled, first_bucket_mb=WEIGHT_MB, bucket_mb=WEIGHT_MB):
        for s in range(3):
            events.append((functp.process_index(), f"step {s}", None))
            q = {k: v.detach().clone() for k, v in params.items()}
            if how == "func_grad":
                g = torch.func.grad(step)(q, functp.shard(x, mesh, P("dp")))
            else:
                q = {k: v.requires_grad_() for k, v in q.items()}
                step(q, functp.shard(x, mesh, P("dp"))).backward()
                g = {k: v.grad for k, v in q.items()}
            assert_tree_close(g, ref, f"step {s} grads")
    assert apply.replay_status() == ["replayed"], apply.replay_status()
    # (nothing of the step is held after it: the tracker caches its aliases)
    assert apply._call.late is None and apply._call.late_tracker is None


@pytest.mark.parametrize("how", ["tape", "func_grad"])
def test_a_replayed_modules_buckets_launch_during_its_backward(monkeypatch, how):
    # the replay aliases the module's parameters as it starts; their launch points are
    # made as each layer starts (made at the start, all buckets waited for the whole
    # backward: the first launch came after layer 0's gradient, on the code before)
    ev = _order(monkeypatch, how, True, _planned_body, "all_reduce")
    for s in (0, 2):
        start = {q: ev.index((q, f"step {s}")) for q in (0, 1)}
        r = min((0, 1), key=lambda q: ev.index((q, "launch"), start[q]))
        first = ev.index((r, "launch"), start[r])
        assert ev.index((r, "backward", LAYERS - 1), start[r]) < first, (s, ev)
        assert first < ev.index((r, "backward", 0), start[r]), (s, ev)


@pytest.mark.parametrize("how", ["tape", "func_grad"])
def test_backward_computes_while_a_bucket_is_in_flight(monkeypatch, how):
    ev = _order(monkeypatch, how, True)
    r = next(e[0] for e in ev if e[1] == "launch")      # whichever rank ran first
    first = ev.index((r, "launch"))           # the last layer's gradient bucket
    computed = ev.index((r, "backward", 0))   # the backward reached layer 0's output
    peer = ev.index((1 - r, "launch"))        # the other rank joins that all-reduce
    waited = ev.index((r, "wait"))
    # launched, then layers 3..1 computed before the other rank even joined: the
    # all-reduce was in flight during that compute; the wait comes after all of it
    assert first < computed < peer and computed < waited, ev
    # (and it was launched as soon as the last layer's gradient was in: one per layer)
    assert ev.count((r, "launch")) == LAYERS, ev
    assert ev.index((r, "backward", LAYERS - 1)) < first < ev.index((r, "backward", LAYERS - 2)), ev

    # without overlap: one bucket, launched after the whole backward, waited at once
    ev = _order(monkeypatch, how, False)
    r = next(e[0] for e in ev if e[1] == "launch")
    assert ev.count((r, "launch")) == 1, ev
    i = ev.index((r, "launch"))
    assert ev.index((r, "backward", 0)) < i and ev[i + 1] == (r, "wait"), ev


def test_fsdp_reduce_scatter_in_flight_during_the_backward(monkeypatch):
    ev = _order(monkeypatch, "func_grad", True, _fsdp_ordered_body, "reduce_scatter")
    r = next(e[0] for e in ev if e[1] == "launch")
    first = ev.index((r, "launch"))           # the last layer's gradient reduce-scatter
    assert ev.index((r, "backward", LAYERS - 1)) < first < ev.index((r, "backward", 0)), ev
    assert ev.index((r, "backward", 0)) < ev.index((1 - r, "launch")), ev   # peer not yet in
    assert ev.index((r, "backward", 0)) < ev.index((r, "wait")), ev
    ev = _order(monkeypatch, "func_grad", False, _fsdp_ordered_body, "reduce_scatter")
    r = next(e[0] for e in ev if e[1] == "launch")
    i = ev.index((r, "launch"))               # without overlap: waited on at once
    assert ev[i + 1] == (r, "wait") and i < ev.index((r, "backward", 0)), ev


# -- launch points: one per input while the order is learnt, then one per bucket --------

def _later_steps(counted, how):
    """Four dp=2 steps, buckets of two weights: tape (the order is learnt), ``how``,
    a ``create_graph`` step (nothing deferred: the cotangents go on to the aliases'
    pvary), then a step in which rank 1 skips the first layer (its weight's
    gradient sent as zeros). Each step's gradients against the unsharded program's;
    returns the sizes of the launch points each step made on this rank."""
    mesh = functp.make_mesh((2,), ("dp",))
    p, x = _params(), randn(2 * B, D, seed=9)
    me = functp.process_index()

    def forward(p, x, skip):
        h = x
        for i in range(LAYERS):
            if not (skip and i == 0):
                h = torch.tanh(h @ p[f"w{i}"])
        return h.square().mean()

    sizes = []
    for s, kind in enumerate(("tape", how, "create_graph", "skip")):
        skip = kind == "skip"
        step = functp.shard_map(
            lambda p, x: functp.pmean(forward(p, x, skip and me == 1), "dp"),
            mesh, in_specs=(P(), P("dp")), out_specs=P())
        xs = list(x.split(B))
        ref = torch.func.grad(lambda p: (forward(p, xs[0], False)
                                         + forward(p, xs[1], skip)) / 2)(p)
        local = functp.shard(x, mesh, P("dp"))
        counted.pop(me, None)
        with overlap(first_bucket_mb=2 * WEIGHT_MB, bucket_mb=2 * WEIGHT_MB):
            if kind == "func_grad":
                g = torch.func.grad(step)(p, local)
            else:
                q = {k: v.clone().requires_grad_() for k, v in p.items()}
                g = dict(zip(q, torch.autograd.grad(step(q, local), list(q.values()),
                                                    create_graph=kind == "create_graph")))
        assert_tree_close(g, ref, f"step {s} ({kind}) grads")
        sizes.append(sorted(counted.get(me, [])))
    return sizes


@pytest.mark.parametrize("how", ["tape", "func_grad"])
def test_later_steps_launch_each_bucket_from_one_point(monkeypatch, how):
    # at the first backward each weight's gradient is a launch point of its own (the
    # order they come in is learnt, as DDP rebuilds its buckets once); after it the
    # buckets are cut at the entry and each passes one launch point (on the code
    # before: one per weight at every step)
    from functp.ops import _overlap
    counted: dict = {}
    ready = _overlap.grad_ready

    def counting(xs, token):
        counted.setdefault(functp.process_index(), []).append(len(xs))
        return ready(xs, token)

    monkeypatch.setattr(_overlap, "grad_ready", counting)
    for sizes in functp.simulate(_later_steps, 2, counted, how, check=False):
        assert sizes == [[1] * LAYERS] + [[2] * (LAYERS // 2)] * 3, sizes


# -- errors ----------------------------------------------------------------------------

def _skips_backward():
    mesh = functp.make_mesh((2,), ("dp",))
    p, x = _params(), randn(2 * B, D, seed=9)
    with overlap(first_bucket_mb=WEIGHT_MB, bucket_mb=WEIGHT_MB):
        if functp.process_index() == 1:
            _dp_step(mesh, "forward", p, functp.shard(x, mesh, P("dp")))
            return "returned"
        return _dp_step(mesh, "tape", p, functp.shard(x, mesh, P("dp")))


def test_a_failed_bucket_names_its_collective():
    with pytest.raises(functp.ShardingError) as e:
        functp.simulate(_skips_backward, 2, check=False, timeout=20)
    assert "all_reduce(sum) over ('dp',)" in str(e.value), str(e.value)


def test_set_overlap_checks_and_restores():
    prev = functp.set_overlap(bucket_mb=2.0)
    try:
        assert functp.set_overlap()["bucket_mb"] == 2.0
        with pytest.raises(ValueError, match="bucket_mb must be > 0"):
            functp.set_overlap(bucket_mb=0)
        with pytest.raises(ValueError, match="min_buckets must be an int >= 1"):
            functp.set_overlap(min_buckets=0)
    finally:
        functp.set_overlap(**prev)
    assert functp.set_overlap() == prev


def test_deferring_waits_once_and_hands_out_the_unfinished_result():
    def body():
        mesh = functp.make_mesh((2,), ("x",))
        g = mesh.axis_group(("x",))
        x = torch.full((3,), 1.0 + functp.process_index())
        with prim.deferring() as pending:
            y = prim.all_reduce(x, g)
        assert len(pending) == 1 and pending[0].early is y
        out = pending[0].wait()
        assert out is pending[0].wait()       # waited once
        return y
    assert [t.tolist() for t in functp.simulate(body, 2, check=False)] == [[3.0] * 3] * 2




def _sinks_alive(how, steps):
    """Sinks made and still alive in this process after ``steps`` dp steps of a parallelized
    transformers Llama (replayed after the first, on the same parameter tensors) on
    each rank and a collection,
    every rank past its steps (a psum on each side of the count); the last step's
    gradients against the unsharded model's."""
    import gc
    import transformers
    from functp.ops._overlap import Sink
    mesh = functp.make_mesh((2, 1), ("dp", "tp"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).double()
    ids = torch.randint(32, (2, 6), generator=torch.Generator().manual_seed(1))

    def lm_loss(logits):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    ref = torch.func.grad(lambda q: lm_loss(torch.func.functional_call(
        model, q, (ids,), {"use_cache": False}).logits))(dict(model.named_parameters()))
    apply, params, specs = functp.parallelize(copy.deepcopy(model), mesh, "auto")
    step = functp.shard_map(
        lambda p, i: functp.pmean(lm_loss_local(apply(p, i, use_cache=False).logits, i), "dp"),
        mesh, in_specs=(specs, P("dp")), out_specs=P())
    together = functp.shard_map(lambda t: functp.psum(t, "dp"), mesh, in_specs=P("dp"),
                                out_specs=P())
    local_ids = functp.shard(ids, mesh, P("dp"))
    together(torch.ones(2))
    gc.collect()            # (those of earlier tests in this process: not this one's)
    before = {id(o) for o in gc.get_objects() if type(o) is Sink}
    together(torch.ones(2))
    # the same parameters every step, as a training loop passes them; buckets of one
    # 16 x 16 weight (several buckets: their launch points are autograd nodes)
    q = {k: v.detach().clone().requires_grad_(how == "tape") for k, v in params.items()}
    with overlap(first_bucket_mb=16 * 16 * 8 / 2**20, bucket_mb=16 * 16 * 8 / 2**20):
        for _ in range(steps):
            if how == "func_grad":
                g = torch.func.grad(step)(q, local_ids)
            elif how == "value_and_grad":
                g = functp.value_and_grad(step)(q, local_ids)[1]
            else:
                g = dict(zip(q, torch.autograd.grad(step(q, local_ids), list(q.values()))))
    assert_tree_close(g, ref, "grads")
    del q, g
    together(torch.ones(2))
    gc.collect()
    alive = sum(type(o) is Sink and id(o) not in before for o in gc.get_objects())
    together(torch.ones(2))
    return alive


def lm_loss_local(logits, ids):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("how", ["tape", "func_grad", "value_and_grad"])
def test_nothing_of_a_step_outlives_it(run, how):
    # a body's gradient buckets (its Sink) held its autograd nodes, whose graph held
    # the Sink back through C++ edges the garbage collector does not see: every step's
    # Sink, nodes and entry tensors leaked (623 objects a step of a transformers
    # Llama, and a full collection of the whole heap every ~100 steps, 180 ms each)
    pytest.importorskip("transformers")
    assert run(2, _sinks_alive, how, 3) == [0, 0], "every step's Sink leaked"
