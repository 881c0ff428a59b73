"""Every bad input raises ShardingError on every rank, before any communication, with
a message naming the leaf, the shape, the spec and the fix."""
from __future__ import annotations

import pytest
import torch

import functp
from functp import P, ShardingError


def _mesh():
    return functp.make_mesh((2,), ("tp",))


def _raises(fn, *words):
    with pytest.raises(ShardingError) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in error message: {msg}"
    return msg


def _ident(*a):
    return a[0] if len(a) == 1 else a


def _in_spec_errors():
    mesh, w = _mesh(), torch.zeros(4, 6)
    sm = lambda spec: (lambda: functp.shard_map(_ident, mesh, in_specs=({"w": spec},),
                                                out_specs=P())({"w": w}))
    _raises(sm(P("dp")), "args[0]['w']", "(4, 6)", "P('dp')", "'dp'", "('tp',)")
    _raises(sm(P("tp", "tp")), "args[0]['w']", "P('tp', 'tp')", "twice")
    _raises(sm(P(None, None, "tp")), "args[0]['w']", "(4, 6)", "3 entries", "2 dimensions")
    _raises(lambda: functp.shard_map(_ident, mesh, in_specs=({"w": None},), out_specs=P())({"w": w}),
            "in_specs[0]['w']", "P()")
    _raises(lambda: functp.shard_map(_ident, mesh, in_specs=({"v": P()},), out_specs=P())({"w": w}),
            "prefix", "in_specs")
    _raises(lambda: functp.shard_map(_ident, mesh, in_specs=(P(), P()), out_specs=P())(w),
            "prefix")
    _raises(lambda: functp.shard_map(_ident, mesh, in_specs=P(), out_specs=P())(w, scale=2),
            "keyword", "scale")


def _out_spec_errors():
    mesh, w = _mesh(), torch.zeros(4, 6)
    _raises(lambda: functp.shard_map(_ident, mesh, in_specs=P(), out_specs=P("dp"))(w),
            "out_specs for output", "'dp'")
    _raises(lambda: functp.shard_map(lambda x: (x, x), mesh, in_specs=P(), out_specs=(P(),))(w),
            "out_specs", "prefix")
    _raises(lambda: functp.shard_map(_ident, mesh, in_specs=P(), out_specs=P(None, None, "tp"))(w),
            "out_specs for output", "3 entries")


def _shard_errors():
    mesh = _mesh()
    # uneven sizes shard torch.chunk-style (5 rows: 3 and 2) ...
    emb = torch.arange(20.).reshape(5, 4)
    local = functp.shard({"emb": emb}, mesh, {"emb": P("tp")})
    assert torch.equal(local["emb"], torch.chunk(emb, 2)[mesh.coordinate["tp"]])
    # ... but shard_map needs even blocks: reshard in a body says to pad
    _raises(lambda: functp.shard_map(lambda w: functp.reshard(w, mesh, P(), P("tp")), mesh,
                                     in_specs=P(), out_specs=P("tp"))(emb),
            "tree", "(5, 4)", "P('tp')", "pad_to_multiple")
    _raises(lambda: functp.unshard({"emb": torch.zeros(5, 4)}, mesh, {"emb": P("x")}),
            "tree['emb']", "'x'")


def _placement_errors():
    from torch.distributed.tensor.placement_types import Partial, Shard
    mesh, w = _mesh(), torch.zeros(4, 6)
    _raises(lambda: functp.shard(w, mesh, [Partial()]), "Partial", "not a valid input spec")
    _raises(lambda: functp.shard(w, mesh, [Shard(0), Shard(1)]), "2 entries", "1 axes")
    # and a valid placement list works like the P it stands for
    assert torch.equal(functp.shard(w, mesh, [Shard(1)]), functp.shard(w, mesh, P(None, "tp")))


def _collective_errors():
    mesh = _mesh()
    x = torch.zeros(3, 4)
    _raises(lambda: functp.psum(x, "tp"), "outside a shard_map", "psum")
    _raises(lambda: functp.axis_index("tp"), "outside a shard_map")
    body = lambda f: (lambda: functp.shard_map(f, mesh, in_specs=P(), out_specs=P())(x))
    _raises(body(lambda x: functp.psum(x, "dp")), "psum", "unknown mesh axis 'dp'", "('tp',)")
    _raises(body(lambda x: functp.all_gather(x, ("tp", "tp"))), "twice")
    _raises(body(lambda x: functp.psum_scatter(x, "tp")), "psum_scatter", "(3, 4)",
            "exactly 2", "tiled=True")
    _raises(body(lambda x: functp.psum_scatter(x, "tp", tiled=True)), "multiple of 2")
    _raises(body(lambda x: functp.all_to_all(x, "tp", 0, 1, tiled=True)), "all_to_all",
            "split_axis=0", "multiple of 2")
    _raises(body(lambda x: functp.all_gather(x, "tp", axis=3)), "axis=3", "out of range")
    _raises(body(lambda x: functp.ppermute(x, "tp", [(0, 1), (1, 1)])), "twice")
    _raises(body(lambda x: functp.ppermute(x, "tp", [(0, 2)])), "index 2", "0..1")


def _short_errors():
    # a spec tree that does not fit a 40-leaf tree: the leaf that differs, no values
    mesh = _mesh()
    tree = {f"layer{i}": torch.randn(64) for i in range(40)}
    specs = {f"layer{i}": P() for i in range(39)}
    msg = _raises(lambda: functp.shard(tree, mesh, specs), "missing key(s) 'layer39'", "prefix")
    assert len(msg) < 600 and "tensor(" not in msg, msg
    msg = _raises(lambda: functp.shard(tree, mesh, {"layer0": tree["layer0"]}), "not a spec",
                  "shape (64,)")
    assert "tensor(" not in msg, msg


def _nested_error():
    mesh, x = _mesh(), torch.zeros(2)
    inner = functp.shard_map(_ident, mesh, in_specs=P(), out_specs=P())
    _raises(lambda: functp.shard_map(inner, mesh, in_specs=P(), out_specs=P())(x), "nest")
    # a nested body's blocks are cut from the outer body's whole values: evenly
    mesh2 = functp.make_mesh((1, 2), ("dp", "tp"))
    inner = functp.shard_map(_ident, mesh2, in_specs=P("tp"), out_specs=P("tp"),
                             axis_names={"tp"})
    outer = functp.shard_map(inner, mesh2, in_specs=P(), out_specs=P(), axis_names={"dp"})
    _raises(lambda: outer(torch.zeros(5, 2)), "in_specs for args[0] (shape (5, 2))",
            "P('tp') splits dimension 0 of size 5 over ('tp',) of size 2", "pad_to_multiple",
            "mesh Mesh(")


def _mesh_errors():
    _raises(lambda: functp.make_mesh((4,), ("x",)), "4 ranks", "2 processes")
    _raises(lambda: functp.make_mesh((2, 1), ("x",)), "2 sizes", "1 axis names")
    _raises(lambda: functp.make_mesh((1, 2), ("x", "x")), "distinct")
    _raises(lambda: functp.shard_map(_ident, "mesh", in_specs=P(), out_specs=P()), "functp.Mesh")
    _raises(lambda: functp.shard_map(_ident, _mesh(), in_specs=None, out_specs=P()), "in_specs")


@pytest.mark.parametrize("body", [_in_spec_errors, _out_spec_errors, _shard_errors,
                                  _placement_errors, _collective_errors, _short_errors, _nested_error,
                                  _mesh_errors],
                         ids=lambda b: b.__name__.strip("_"))
def test_bad_input_raises_on_every_rank(run, body):
    run(2, body)


def test_make_mesh_without_launcher_explains_torchrun():
    # no process group here and no RANK/WORLD_SIZE: asking for 4 ranks must not hang
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    _raises(lambda: functp.make_mesh((4,), ("x",)), "torchrun", "--nproc-per-node 4")


def test_packed_spec_names_a_split_dimension_and_blocks():
    assert repr(P("tp", None, packed={0: 2})) == "P('tp', None, packed={0: 2})"
    for bad in ({1: 2}, {0: 1}, {3: 2}):
        _raises(lambda: P("tp", None, packed=bad), "packing names a split dimension")


def _table_errors() -> list[str]:
    # every entry of the table, in order, after the setup: what each one raised
    import _error_table as table
    env: dict = {}
    exec(table.SETUP, env)
    out, debug = [], functp.debug_enabled()      # (an entry turns the check mode on)
    try:
        for e in table.ERRORS:
            try:
                exec(e.code, env)
                out.append("(nothing raised)\n")
            except Exception as x:  # noqa: BLE001 - compared with the table below
                out.append(f"{type(x).__name__}: {x}\n")
    finally:
        functp.set_debug(debug)
    return out


def test_every_error_of_the_table_raises_exactly_its_message_on_every_rank(run):
    # the errors docs/troubleshooting.md shows (tests/_error_table.py), on four gloo
    # processes (checkpoints and DTensor need torch.distributed's default group)
    import _error_table as table
    want = [e.shown() for e in table.ERRORS]
    for rank, got in enumerate(run(4, _table_errors, gloo=True)):
        for e, g, w in zip(table.ERRORS, got, want):
            assert g == w, f"rank {rank}, the entry\n{e.code}raised\n{g}where the table has\n{w}"
