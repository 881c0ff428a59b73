"""reshard between every pair of specs (1-d and 2-d meshes, even and uneven sizes)
against an independent reference (the target block cut from the full value with
torch.chunk, in the test), bit for bit; its communication; the planner alone (no
ranks); uneven shard/unshard, global_shapes and the padding helpers; reshard inside a
shard_map body under torch.func.grad against the oracle gradient."""
from __future__ import annotations

import itertools

import pytest
import torch

import functp
from functp import P, ShardingError
from functp.mapping._reshard_plan import plan
from _oracle import check_program, randn


def _specs(names, ndim=2):
    """Every spec of an ``ndim``-d tensor: each dimension gets no axis, one axis or an
    ordered tuple of axes, no axis twice."""
    options = [()] + [t for r in range(1, len(names) + 1)
                      for t in itertools.permutations(names, r)]
    out = []
    for combo in itertools.product(options, repeat=ndim):
        flat = [a for t in combo for a in t]
        if len(flat) == len(set(flat)):
            out.append(P(*[None if not t else t[0] if len(t) == 1 else t for t in combo]))
    return out


def reference_block(full, spec, mesh):
    """This rank's block of ``full`` under ``spec``, cut with torch.chunk axis by axis
    (major first): the layout rule stated in the docs, computed without functp."""
    x = full
    for d in range(len(spec)):
        e = spec[d]
        for a in (() if e is None else (e,) if isinstance(e, str) else e):
            pieces = torch.chunk(x, mesh.shape[a], d)
            i = mesh.coordinate[a]
            x = pieces[i] if i < len(pieces) else x.narrow(d, x.shape[d], 0)
    return x


def _no_comm(src, dst, mesh):
    """No data needs to move when every dimension keeps its axes (of size > 1) and only
    gains more at its minor end."""
    def axes(s, d):
        return tuple(a for a in s.dim_axes(d) if mesh.shape[a] > 1)
    return all(axes(dst, d)[:len(axes(src, d))] == axes(src, d) for d in range(2))


def _all_pairs_body(mesh_shape, names, shapes, given):
    mesh = functp.make_mesh(mesh_shape, names)
    specs = _specs(names)
    counts = {}
    for k, gshape in enumerate(shapes):
        full = randn(*gshape, seed=k)
        for src, dst in itertools.product(specs, specs):
            local = functp.shard(full, mesh, src)
            assert torch.equal(local, reference_block(full, src, mesh)), (gshape, src)
            with functp.comm_log() as log:
                out = functp.reshard(local, mesh, src, dst, shapes=gshape)
            assert torch.equal(out, reference_block(full, dst, mesh)), (gshape, src, dst)
            data = len(log)
            assert (data == 0) == _no_comm(src, dst, mesh), (src, dst, log.events)
            counts[(str(src), str(dst))] = data
            if not given:   # without shapes=: one small exchange first, when data moves
                with functp.comm_log() as log:
                    again = functp.reshard(local, mesh, src, dst)
                assert torch.equal(again, out), (gshape, src, dst)
                assert len(log) == data + (1 if data else 0), (src, dst, log.events)
            # and back to the full value
            assert torch.equal(functp.unshard(out, mesh, dst, shapes=gshape), full), (
                gshape, src, dst)
    return counts


@pytest.mark.parametrize("world,mesh_shape,names,shapes", [
    (1, (1,), ("x",), [(3, 2)]),
    (2, (2,), ("x",), [(4, 6), (3, 5), (1, 3)]),
    (4, (4,), ("x",), [(8, 4), (10, 3), (2, 5)]),
    (4, (2, 2), ("a", "b"), [(4, 8), (5, 3), (2, 3)]),
], ids=["1", "2", "4", "2x2"])
def test_reshard_every_pair_matches_shard_of_full(run, world, mesh_shape, names, shapes):
    counts = run(world, _all_pairs_body, mesh_shape, names, shapes, True)[0]
    # the minimum for a few canonical moves
    if names == ("a", "b"):
        assert counts[("P('a', 'b')", "P(None, None)")] == 1               # one gather over (a, b)
        assert counts[("P(('a', 'b'), None)", "P('a', 'b')")] == 1  # one all_to_all
        assert counts[("P(('a', 'b'), None)", "P(('b', 'a'), None)")] == 1
        assert counts[("P('a', None)", "P(('a', 'b'), None)")] == 0
        assert max(counts.values()) <= 2


def test_reshard_without_shapes_exchanges_sizes_once(run):
    # uneven sizes, global shapes learned by one small all-gather per call
    run(4, _all_pairs_body, (2, 2), ("a", "b"), [(5, 3)], False)


def _apply(src, steps):
    """The layout a plan's steps lead to, stepped through by their stated meaning."""
    cur = list(src)
    for st in steps:
        if st[0] == "slice":
            cur[st[1]] = cur[st[1]] + st[2]
        elif st[0] == "a2a":
            _, d, e, axes = st
            assert cur[d][-len(axes):] == axes, (src, steps)
            cur[d], cur[e] = cur[d][:-len(axes)], cur[e] + axes
        else:
            for d, axes in st[1]:
                assert cur[d][-len(axes):] == axes, (src, steps)
                cur[d] = cur[d][:-len(axes)]
    return tuple(cur)


def test_planner_alone_reaches_every_target():
    # a pure function of the layouts: no ranks, no mesh
    assert plan((("x",), ()), ((), ("x",))) == (("a2a", 0, 1, ("x",)),)
    assert plan(((), ()), (("x",), ())) == (("slice", 0, ("x",)),)
    assert plan((("a",), ("b",)), ((), ())) == (("gather", ((0, ("a",)), (1, ("b",)))),)
    lays = [tuple(() if s[d] is None else (s[d],) if isinstance(s[d], str) else s[d]
                  for d in range(2)) for s in _specs(("a", "b", "c"))]
    lays = [tuple(lay) + ((),) * (2 - len(lay)) for lay in lays]
    for src, dst in itertools.product(lays, lays):
        steps = plan(src, dst)
        assert _apply(src, steps) == dst, (src, dst, steps)
        assert len([s for s in steps if s[0] != "slice"]) <= 3, (src, dst, steps)


def _eight_body():
    mesh = functp.make_mesh((2, 4), ("a", "b"))
    specs = [P(), P("b"), P(("a", "b")), P(("b", "a")), P("a", "b"), P(None, ("a", "b"))]
    for gshape in [(10, 6), (16, 8)]:
        full = randn(*gshape)
        for src, dst in itertools.product(specs, specs):
            out = functp.reshard(functp.shard(full, mesh, src), mesh, src, dst, shapes=gshape)
            assert torch.equal(out, reference_block(full, dst, mesh)), (gshape, src, dst)


def _comm_body():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    full = randn(8, 4)
    rep = functp.shard(full, mesh, P())
    with functp.comm_log() as log:
        a = functp.reshard(rep, mesh, P(), P("tp"))                    # local slice
        same = functp.reshard(a, mesh, P("tp"), P("tp"))               # nothing to do
        b = functp.reshard(a, mesh, P("tp"), P(("tp", "dp")))          # slice again
    assert len(log) == 0 and same is a
    assert torch.equal(b, functp.shard(full, mesh, P(("tp", "dp"))))
    assert a.data_ptr() != rep.data_ptr(), "a slice outside shard_map is a new tensor"

    cases = [(P("tp"), P(None, "tp"), [("all_to_all", ("tp",))]),
             (P("tp"), P(), [("all_gather", ("tp",))]),
             (P(("dp", "tp")), P("dp", "tp"), [("all_to_all", ("tp",))]),
             (P("dp", "tp"), P(), [("all_gather", ("dp", "tp"))]),
             (P("dp", "tp"), P("tp", "dp"), [("all_gather", ("dp", "tp"))])]
    for src, dst, want in cases:
        x = functp.shard(full, mesh, src)
        with functp.comm_log() as log:
            y = functp.reshard(x, mesh, src, dst, shapes=full.shape)
        assert [(e.op, e.axes) for e in log.events] == want, (src, dst, log.events)
        assert torch.equal(y, reference_block(full, dst, mesh)), (src, dst)
        # without shapes: the same, after one small all_gather of the block shapes
        with functp.comm_log() as log:
            y = functp.reshard(x, mesh, src, dst)
        assert [(e.op, e.axes) for e in log.events] == [("all_gather", ("dp", "tp"))] + want, (
            src, dst, log.events)
        assert log.events[0].nbytes == 2 * 8, "the shapes of one 2-d block, int64"
        assert torch.equal(y, reference_block(full, dst, mesh)), (src, dst, "without shapes=")

    # a whole tree; non-tensor leaves pass through
    tree = {"w": full, "b": randn(4, seed=1), "n": 3}
    src = {"w": P("tp"), "b": P(), "n": P()}
    dst = {"w": P(None, ("dp", "tp")), "b": P("dp"), "n": P()}
    out = functp.reshard(functp.shard(tree, mesh, src), mesh, src, dst)
    want = functp.shard(tree, mesh, dst)
    assert out["n"] == 3 and torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])


def test_reshard_communication(run):
    run(4, _comm_body)


def _uneven_body():
    mesh = functp.make_mesh((4,), ("x",))
    r = mesh.coordinate["x"]
    ten, two = randn(10, 3), randn(2, 5, seed=1)
    a = functp.shard(ten, mesh, P("x"))
    b = functp.shard(two, mesh, P("x"))
    assert a.shape[0] == [3, 3, 3, 1][r] and b.shape[0] == [1, 1, 0, 0][r]
    assert torch.equal(a, torch.chunk(ten, 4)[r])
    # unshard recovers the global shapes itself, or takes them
    assert torch.equal(functp.unshard(a, mesh, P("x")), ten)
    assert torch.equal(functp.unshard(b, mesh, P("x"), shapes=(2, 5)), two)
    got = functp.global_shapes({"a": a, "b": b, "k": "keep"}, mesh, P("x"))
    assert got == {"a": torch.Size([10, 3]), "b": torch.Size([2, 5]), "k": "keep"}
    # more ranks than columns, several axes on one dimension of a 2-d mesh
    assert torch.equal(functp.unshard(functp.reshard(b, mesh, P("x"), P(None, "x")), mesh,
                                      P(None, "x")), two)

    # blocks that no torch.chunk layout explains: the same error on every rank
    bad = torch.zeros(3 if r == 0 else 2, 2)
    with pytest.raises(ShardingError) as e:
        functp.unshard({"w": bad}, mesh, P("x"))
    for w in ["tree['w']", "[3, 2, 2, 2]", "dimension 0", "P('x')"]:
        assert w in str(e.value), str(e.value)
    with pytest.raises(ShardingError, match="global shape"):
        functp.reshard(a, mesh, P("x"), P(), shapes=(10, 4))      # wrong shape given


def test_uneven_shard_unshard_and_global_shapes(run):
    run(4, _uneven_body)


def _pad_body():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    tree = {"emb": randn(10, 3), "w": randn(5, 6, seed=1), "s": randn(3, seed=2)}
    specs = {"emb": P(("dp", "tp")), "w": P("tp", "dp"), "s": P()}
    shapes = {k: v.shape for k, v in tree.items()}
    padded = functp.pad_to_multiple(tree, mesh, specs)
    assert padded["emb"].shape == (12, 3) and padded["w"].shape == (6, 6)
    assert padded["s"] is tree["s"] or torch.equal(padded["s"], tree["s"])
    even = functp.shard(padded, mesh, specs)
    # the same blocks from the uneven blocks, without the full tensors
    local = functp.shard(tree, mesh, specs)
    from_local = functp.pad_to_multiple(local, mesh, specs, shapes=shapes)
    for k in tree:
        assert torch.equal(from_local[k], even[k]), k
    back = functp.unpad(even, shapes, mesh=mesh, specs=specs)
    for k in tree:
        assert torch.equal(back[k], local[k]), k
    assert torch.equal(functp.unpad(functp.unshard(even, mesh, specs), shapes)["emb"], tree["emb"])

    # shard_map on the padded blocks: zero rows do not change a sum of squares
    def body(p):
        return functp.psum((p["emb"] ** 2).sum() + (p["w"] ** 2).sum(), ("dp", "tp")) \
            + (p["s"] ** 2).sum()
    step = functp.shard_map(body, mesh, in_specs=(specs,), out_specs=P())
    g = torch.func.grad(step)(even)
    full_g = functp.unpad(functp.unshard(g, mesh, specs), shapes)
    for k in tree:
        torch.testing.assert_close(full_g[k], 2 * tree[k], rtol=0, atol=1e-12)

    # uneven blocks made by functp are marked, so shard_map can refuse them clearly
    from functp.mesh._layout import check_even_block
    check_even_block(even["emb"], specs["emb"], mesh, "args[0]['emb']")
    with pytest.raises(ShardingError) as e:
        check_even_block(local["emb"], specs["emb"], mesh, "args[0]['emb']")
    for w in ["args[0]['emb']", "(10, 3)", "pad_to_multiple", "multiple of 4"]:
        assert w in str(e.value), str(e.value)


def test_padding_helpers_and_shard_map(run):
    run(4, _pad_body)


# ---------------------------------------------------------------------------------
# inside shard_map: differentiable


def _grad_1d_body(check_vma):
    mesh = functp.make_mesh((2,), ("tp",))
    w, x = randn(6, 4), randn(3, 6, seed=1)

    def g_move(w, x):
        return ((x @ w) ** 2).sum()

    def l_move(w, x):       # rows -> columns: one all_to_all, backward its inverse
        wc = functp.reshard(w, mesh, P("tp"), P(None, "tp"))
        return functp.psum(((x @ wc) ** 2).sum(), "tp")
    log = check_program(mesh, g_move, l_move, (w, x), (P("tp"), P()), check_vma=check_vma)
    assert log.count("all_to_all") == 2

    def g_slice(w):
        return (w ** 3).sum()

    def l_slice(w):         # replicated -> split: no forward communication
        return functp.psum((functp.reshard(w, mesh, P(), P("tp")) ** 3).sum(), "tp")
    check_program(mesh, g_slice, l_slice, (w,), (P(),), check_vma=check_vma)
    split = functp.shard_map(lambda w: functp.reshard(w, mesh, P(), P("tp")), mesh,
                             in_specs=P(), out_specs=P("tp"), check_vma=check_vma)
    with functp.comm_log() as log:
        assert torch.equal(split(w), functp.shard(w, mesh, P("tp")))
    assert len(log) == 0

    def g_gather(w, x):
        return (x @ w).tanh().sum()

    def l_gather(w, x):     # split -> replicated: an invariant all-gather
        return (x @ functp.reshard(w, mesh, P("tp"), P())).tanh().sum()
    check_program(mesh, g_gather, l_gather, (w, x), (P("tp"), P()), check_vma=check_vma)


def _grad_2d_body(check_vma):
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    w, x = randn(8, 4), randn(4, 8, seed=1)

    def glob(w, x):
        return ((x @ w).sin() ** 2).sum()

    def loc(w, x):          # nested split -> one axis per dimension -> split the other way
        w2 = functp.reshard(w, mesh, P(("dp", "tp")), P("dp", "tp"))
        w3 = functp.reshard(w2, mesh, P("dp", "tp"), P(None, ("tp", "dp")))
        return functp.psum(((x @ w3).sin() ** 2).sum(), ("dp", "tp"))
    check_program(mesh, glob, loc, (w, x), (P(("dp", "tp")), P()), check_vma=check_vma)

    def loc_tree(p, x):     # a tree with a replicated leaf; batch split over dp
        q = functp.reshard(p, mesh, {"w": P("tp"), "b": P()}, {"w": P(None, "tp"), "b": P("tp")})
        h = x @ q["w"] + q["b"]
        return functp.psum((h ** 2).sum(), ("dp", "tp"))

    def glob_tree(p, x):
        return ((x @ p["w"] + p["b"]) ** 2).sum()
    p = {"w": w, "b": randn(4, seed=2)}
    check_program(mesh, glob_tree, loc_tree, (p, x), ({"w": P("tp"), "b": P()}, P("dp")),
                  check_vma=check_vma)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_reshard_in_body_gradient_1d(run, check_vma):
    run(2, _grad_1d_body, check_vma)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_reshard_in_body_gradient_2d(run, check_vma):
    run(4, _grad_2d_body, check_vma)


def _body_errors():
    mesh = functp.make_mesh((2,), ("tp",))
    other = functp.make_mesh((2, 1), ("a", "b"))
    x = torch.zeros(3, 4)

    def uneven(x):
        return functp.reshard(x, mesh, P(), P("tp"))
    with pytest.raises(ShardingError) as e:
        functp.shard_map(uneven, mesh, in_specs=P(), out_specs=P("tp"))(x)
    for w in ["inside shard_map", "tree", "(3, 4)", "P('tp')", "pad_to_multiple"]:
        assert w in str(e.value), str(e.value)
    with pytest.raises(ShardingError, match="another mesh"):
        functp.shard_map(lambda x: functp.reshard(x, other, P(), P("a")), mesh,
                         in_specs=P(), out_specs=P())(x)


def test_reshard_errors_in_body(run):
    run(2, _body_errors)
