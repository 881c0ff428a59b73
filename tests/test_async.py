"""Forward collectives waited on at the first use of their result (functp/ops/_lazy.py).

A body's psum / all_gather / psum_scatter / ppermute / pmax is launched at once and
waited on just before an op reads its result: the order of events shows compute that
does not read it running before the wait (and the opposite with
``set_overlap(forward=False)``). Values, gradients and comm_log are those of the eager
program (bit for bit) and of the unsharded float64 program (2 and 4 ranks, a 2x2
mesh; torch.func.grad, tape autograd, value_and_grad); vmap of grad and grad of grad
are unchanged; a result returned unused, an exception leaving the body and a failed
collective leave nothing in flight and no mode on the dispatch stack.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import functp
import functp.ops._lazy as lazy
import functp.ops._primitives as prim
from functp import P
from functp.runtime._torch_compat import dispatch_stack_len
from _oracle import assert_tree_close, randn

D = 8


@contextlib.contextmanager
def forward(on: bool):
    prev = functp.set_overlap(forward=on)
    try:
        yield
    finally:
        functp.set_overlap(**prev)


def _idle() -> tuple[int, int]:
    """(modes on this thread's dispatch stack, pending collectives): (0, 0) between steps."""
    return dispatch_stack_len(), len(lazy._state.pending)


# -- a program with every lazily waited collective ----------------------------------------

def _chunk_loss(p, x, n_tp: int):
    """The unsharded program on one data-parallel chunk: an MLP whose second layer is
    row-parallel, a weight all-gathered (FSDP) before it is needed, a pmax, a ring
    shift of a weight's blocks (ppermute) and a psum_scatter of a square."""
    y = torch.tanh(x @ p["w1"]) @ p["w2"]
    v = p["v"]
    shifted = torch.roll(v.unflatten(0, (n_tp, -1)), 1, 0).flatten(0, 1)
    return ((y * torch.sin(x)).sum() + (x @ v).square().mean() + y.amax(0).sum()
            + (shifted * v).sum() + (v * v).sum())


def _local(n_tp: int, dp: bool):
    def loss(p, x):
        full_v = functp.all_gather(p["v"], "tp", tiled=True)     # prefetched: used late
        h = torch.tanh(x @ p["w1"])
        y = functp.psum(h @ p["w2"], "tp")
        z = torch.sin(x)                                         # reads no result
        m = functp.pmax(y.amax(0), "tp")
        ring = [(i, (i + 1) % n_tp) for i in range(n_tp)]
        shifted = functp.ppermute(p["v"], "tp", ring)
        sq = functp.psum_scatter(full_v * full_v, "tp", tiled=True) / n_tp
        # (full_v varies over tp, as an FSDP gather's result: counted once by the psum)
        out = (y * z).sum() + m.sum() + functp.psum(
            (x @ full_v).square().mean() / n_tp + (shifted * p["v"]).sum() + sq.sum(), "tp")
        return functp.pmean(out, "dp") if dp else out
    return loss


def _value_body(shape, how):
    dp = len(shape) == 2
    mesh = functp.make_mesh(shape, ("dp", "tp") if dp else ("tp",))
    n_dp, n_tp = (shape if dp else (1, shape[0]))
    p = {"w1": randn(D, 2 * n_tp, seed=1), "w2": randn(2 * n_tp, D, seed=2),
         "v": randn(D, D, seed=3)}
    x = randn(4 * n_dp, D, seed=4)
    specs = ({"w1": P(None, "tp"), "w2": P("tp"), "v": P("tp")}, P("dp") if dp else P())
    step = functp.shard_map(_local(n_tp, dp), mesh, in_specs=specs, out_specs=P())
    lp, lx = functp.shard(p, mesh, specs[0]), functp.shard(x, mesh, specs[1])
    results = []
    for on in (True, False):
        with forward(on), functp.comm_log() as log:
            results.append((_grads(step, how, lp, lx), [(e.op, e.axes, e.nbytes) for e in log]))
        assert _idle() == (0, 0), f"forward laziness {on}: collectives left pending {_idle()}"
    ((loss, g), lazy_log), ((loss0, g0), eager_log) = results
    assert lazy_log == eager_log
    assert torch.equal(loss, loss0) and all(torch.equal(g[k], g0[k]) for k in g)  # bit for bit

    def glob(p, x):
        return sum(_chunk_loss(p, c, n_tp) for c in x.chunk(n_dp)) / n_dp
    ref_g, ref_loss = torch.func.grad_and_value(glob)(p, x)
    assert_tree_close(loss, ref_loss, "loss")
    assert_tree_close(functp.unshard(g, mesh, specs[0]), ref_g, "grads")
    return len(lazy_log)


def _grads(step, how, p, x):
    if how == "tape":
        p = {k: v.clone().requires_grad_() for k, v in p.items()}
        loss = step(p, x)
        loss.backward()
        return loss.detach(), {k: v.grad for k, v in p.items()}
    if how == "func_grad":
        g, loss = torch.func.grad_and_value(step)(p, x)
        return loss, g
    loss, g = functp.value_and_grad(step)(p, x)
    return loss, g


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
@pytest.mark.parametrize("how", ["func_grad", "tape", "value_and_grad"])
def test_values_and_gradients_match_eager_and_the_oracle(run, shape, how):
    n = shape[0] * (shape[1] if len(shape) == 2 else 1)
    counts = run(n, _value_body, shape, how)
    assert counts[0] > 5 and len(set(counts)) == 1, counts


def test_the_check_mode_and_gloo_processes_see_the_same(run):
    # the cross-rank check mode reads every collective's input and every output
    assert len(set(functp.simulate(_value_body, 2, (2,), "func_grad", check=True))) == 1
    # ranks as processes, each with its own gloo backend, rather than threads
    assert len(set(run(2, _value_body, (2,), "tape", gloo=True))) == 1


# -- the order of events: compute runs while the collective is in flight -------------------

def _order(monkeypatch, how: str, on: bool, gather: bool = False) -> list:
    """The events of a 2-rank step, in the order they happened: (rank, what).

    Simulated ranks take turns and hand the turn over only where one waits, so a
    collective a rank launched stays in flight (it cannot finish: its peer has not
    launched it yet) until that rank waits: a deliberately slow collective."""
    events: list = []
    record, wait = prim._record, prim._wait
    op = "all_gather" if gather else "all_reduce"

    def launched(o, g, x, how="", ragged=False):
        if o == op and x.numel() > 1:          # (not the loss's pmean)
            events.append((functp.process_index(), "launch"))
        return record(o, g, x, how, ragged)

    def waited(t, o, g):
        if o.startswith(op) and t.numel() > 1:
            events.append((functp.process_index(), "wait"))
        return wait(t, o, g)

    def body():
        mesh = functp.make_mesh((2,), ("tp",))
        w1, w2, x = randn(D, 2 * D, seed=1), randn(2 * D, D, seed=2), randn(4, D, seed=3)

        def loss(w1, w2, x):
            if gather:        # FSDP: a layer's weight gathered a layer ahead
                y = functp.all_gather(w2, "tp", tiled=True)
            else:             # TP: the row-parallel layer's psum
                y = functp.psum(torch.tanh(x @ w1) @ w2, "tp")
            z = torch.sin(x @ x.T)                      # reads nothing of y
            events.append((functp.process_index(), "compute"))
            if gather:
                return functp.pmean((z @ x @ y.T).sum(), "tp")
            return (z @ y).sum()

        specs = (P(None, "tp"), P("tp"), P())
        step = functp.shard_map(loss, mesh, in_specs=specs, out_specs=P())
        lw1, lw2 = functp.shard(w1, mesh, specs[0]), functp.shard(w2, mesh, specs[1])
        with forward(on):
            if how == "tape":
                lw1.requires_grad_()
                lw2.requires_grad_()
                step(lw1, lw2, x).backward()
            else:
                torch.func.grad(step)(lw1, lw2, x)
        return _idle()

    monkeypatch.setattr(prim, "_record", launched)
    monkeypatch.setattr(prim, "_wait", waited)
    assert functp.simulate(body, 2, check=False) == [(0, 0)] * 2
    assert _idle() == (0, 0)        # (modes are per thread: the ranks' left no trace here)
    return events


@pytest.mark.parametrize("how", ["tape", "func_grad"])
@pytest.mark.parametrize("gather", [False, True], ids=["psum", "all_gather"])
def test_compute_runs_while_a_forward_collective_is_in_flight(monkeypatch, how, gather):
    ev = _order(monkeypatch, how, True, gather)
    r = ev[0][0]                                   # whichever rank ran first
    launch, compute = ev.index((r, "launch")), ev.index((r, "compute"))
    peer, wait = ev.index((1 - r, "launch")), ev.index((r, "wait"))
    # launched; the compute that does not read the result ran before the other rank
    # even joined (the collective in flight meanwhile); the wait came after it
    assert launch < compute < peer and compute < wait, ev
    # waited on at once: the opposite order
    ev = _order(monkeypatch, how, False, gather)
    r = ev[0][0]
    i = ev.index((r, "launch"))
    assert ev[i + 1] == (r, "wait") and ev.index((r, "compute")) > i + 1, ev


# -- nested transforms, unused results, exceptions, host reads, failures --------------------

def _nested_body(kind):
    mesh = functp.make_mesh((2,), ("tp",))
    w1, w2, x = randn(D, 4, seed=1), randn(4, D, seed=2), randn(4, D, seed=3)
    step = functp.shard_map(lambda w1, w2, x: (functp.psum(torch.tanh(x @ w1) @ w2, "tp")
                                               * torch.sin(x)).sum(),
                            mesh, in_specs=(P(None, "tp"), P("tp"), P()), out_specs=P())
    glob = lambda w1, w2, x: ((torch.tanh(x @ w1) @ w2) * torch.sin(x)).sum()  # noqa: E731
    lw1, lw2 = functp.shard(w1, mesh, P(None, "tp")), functp.shard(w2, mesh, P("tp"))
    if kind == "vmap_of_grad":          # per-example gradients
        xs = x.unflatten(0, (2, 2))
        f = lambda s: torch.func.vmap(torch.func.grad(s), (None, None, 0))  # noqa: E731
        got, want = f(step)(lw1, lw2, xs), f(glob)(w1, w2, xs)
        assert_tree_close(got, functp.shard(want, mesh, P(None, None, "tp")), "vmap of grad")
    else:                               # a Hessian-vector product
        f = lambda s: torch.func.grad(  # noqa: E731
            lambda a: torch.func.grad(s)(a, lw2 if s is step else w2, x).square().sum())
        got, want = f(step)(lw1), f(glob)(w1)
        assert_tree_close(got, functp.shard(want, mesh, P(None, "tp")), "grad of grad")
    with forward(False):
        same = f(step)(lw1, lw2, xs) if kind == "vmap_of_grad" else f(step)(lw1)
    assert torch.equal(got, same)
    return _idle()


@pytest.mark.parametrize("kind", ["vmap_of_grad", "grad_of_grad"])
def test_nested_transforms_unchanged(run, kind):
    assert run(2, _nested_body, kind) == [(0, 0)] * 2


def _unused_body():
    mesh = functp.make_mesh((2,), ("tp",))
    x = torch.full((3,), 1.0 + functp.process_index(), dtype=torch.float64)

    def body(x):
        s = functp.psum(x, "tp")             # never read in the body
        g = functp.all_gather_invariant(x, "tp", tiled=True)
        return s, g, s.tolist()[0]           # a host read that bypasses dispatch

    s, g, first = functp.shard_map(body, mesh, in_specs=P("tp"),
                                   out_specs=(P(), P(), P()))(x)
    assert _idle() == (0, 0)
    return s.tolist(), g.numpy().tolist(), first


def test_a_pending_result_returned_unused_is_finished():
    out = functp.simulate(_unused_body, 2, check=False)
    assert out == [([3.0] * 3, [1.0] * 3 + [2.0] * 3, 3.0)] * 2


def _unseen_read_body():
    mesh = functp.make_mesh((2,), ("tp",))
    x = torch.full((3,), 1.0 + functp.process_index(), dtype=torch.float64)

    def body(x):
        s = functp.psum(x, "tp")
        torch.sin(x)                         # reads nothing of s: the mode is pushed
        with torch._C.DisableTorchFunction():    # no torch call of the body shows this
            t = s + 1                        # read: only the dispatch mode sees it
        return t

    return functp.shard_map(body, mesh, in_specs=P("tp"), out_specs=P())(x).tolist(), _idle()


def test_the_dispatch_mode_waits_where_no_torch_call_shows_the_read():
    assert functp.simulate(_unseen_read_body, 2, check=False) == [([4.0] * 3, (0, 0))] * 2


def _raising_body():
    mesh = functp.make_mesh((2,), ("tp",))
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)

    def body(x):
        functp.psum(x * 2, "tp")             # launched, pending
        torch.sin(x)                         # reads nothing of it: the mode is pushed
        assert dispatch_stack_len() == 1
        raise ValueError("the body's own error")

    step = functp.shard_map(body, mesh, in_specs=P("tp"), out_specs=P())
    with pytest.raises(ValueError, match="the body's own error"):
        step(x)
    left = _idle()
    again = functp.shard_map(lambda x: functp.psum(x, "tp"), mesh, in_specs=P("tp"),
                             out_specs=P())(x.detach())       # the group still works
    return left, again.tolist(), _idle()


def test_an_exception_leaves_nothing_in_flight():
    assert functp.simulate(_raising_body, 2, check=False) == [((0, 0), [2.0] * 3, (0, 0))] * 2


def _skips_step(unused: bool):
    mesh = functp.make_mesh((2,), ("dp",))
    if functp.process_index() == 1:
        return "returned"                    # never joins the psum

    def body(x):
        s = functp.psum(x, "dp")
        return s if unused else (s * 2).sum()

    step = functp.shard_map(body, mesh, in_specs=P("dp"), out_specs=P())
    try:
        step(torch.ones(3, dtype=torch.float64))
    finally:
        assert _idle() == (0, 0)


@pytest.mark.parametrize("unused", [False, True], ids=["read", "returned"])
def test_a_failed_collective_names_itself_on_its_step(unused):
    with pytest.raises(functp.ShardingError) as e:
        functp.simulate(_skips_step, 2, unused, check=False, timeout=20)
    assert "all_reduce(sum) over ('dp',)" in str(e.value), str(e.value)


def test_set_overlap_forward_is_a_setting():
    prev = functp.set_overlap(forward=False)
    try:
        assert functp.set_overlap()["forward"] is False and not lazy._state.forward
        functp.set_overlap(enabled=False, forward=True)
        assert not lazy._state.forward            # enabled=False: every wait at once
    finally:
        functp.set_overlap(**prev)
    assert functp.set_overlap() == prev and lazy._state.forward == prev["forward"]
