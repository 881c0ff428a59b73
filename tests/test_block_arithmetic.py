"""``_layout``, the one home of block arithmetic, by properties over random shapes,
specs (uneven sizes, empty blocks and packed dimensions included) and 1-d / 2-d / 3-d
meshes, seeded so a failure replays:

- every rank's block, written back where ``_layout`` says it lies, rebuilds the full
  tensor, and each element is held by exactly the ranks the spec replicates it on;
- the blocks are the torch.chunk blocks the docs promise (a reference cut in the test);
- local -> global shapes round trip; placements round trip;
- shard then unshard is the identity through ``functp.simulate`` on 2, 4 and 8 ranks.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

import functp
from functp import P, ShardingError
from functp.mesh import _layout

MESHES = [((2,), ("x",)), ((4,), ("x",)), ((3,), ("x",)), ((2, 2), ("a", "b")),
          ((2, 3), ("a", "b")), ((1, 4), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]


class FakeMesh:
    """The facts ``_layout`` reads from a mesh, for one coordinate: no ranks needed."""

    def __init__(self, sizes, names, coord=None):
        self.axis_names, self.axis_sizes = tuple(names), tuple(sizes)
        self.shape = dict(zip(names, sizes))
        self.coordinate = dict(zip(names, coord or (0,) * len(names)))

    def axis_size(self, axes):
        axes = (axes,) if isinstance(axes, str) else axes
        return math.prod(self.shape[a] for a in axes)

    def at(self, coord):
        return FakeMesh(self.axis_sizes, self.axis_names, coord)

    def coords(self):
        return list(itertools.product(*map(range, self.axis_sizes)))

    def __repr__(self):
        return f"FakeMesh({self.shape})"


def random_spec(rng, names, ndim, packable=None):
    """A random spec: every axis used at most once, each dimension given none, one or
    an ordered tuple of axes; with ``packable`` (shape, sizes) maybe a packed split
    dimension that holds whole, evenly split blocks."""
    free = list(names)
    rng.shuffle(free)
    entries = []
    for _ in range(ndim):
        k = rng.choice([0, 0, 1, 1, 2]) if free else 0
        take, free = tuple(free[:k]), free[k:]
        entries.append(None if not take else take[0] if len(take) == 1 else take)
    packed = {}
    if packable is not None:
        shape, sizes = packable
        for d, e in enumerate(entries):
            axes = () if e is None else (e,) if isinstance(e, str) else e
            n = math.prod(sizes[a] for a in axes)
            if axes and rng.random() < 0.5 and shape[d] % (2 * n) == 0:
                packed[d] = 2
    while entries and entries[-1] is None and rng.random() < 0.5:
        entries.pop()                       # trailing entries may be left out
    return P(*entries, packed=packed or None)


def random_shape(rng, ndim, hi=9):
    return tuple(rng.randint(0, hi) if rng.random() < 0.15 else rng.randint(1, hi)
                 for _ in range(ndim))


def chunk_reference(full, spec, mesh):
    """The block the docs describe, cut with torch.chunk axis by axis (packed: each of
    the packed blocks cut so, then laid end to end)."""
    for d, k in spec.packed:
        parts = torch.chunk(full, k, d)
        sub = P(*[e if i == d else None for i, e in enumerate(spec)])
        full = torch.cat([chunk_reference(p, sub, mesh) for p in parts], d)
        spec = P(*[None if i == d else e for i, e in enumerate(spec)])
    for d in range(len(spec)):
        for a in spec.dim_axes(d):
            pieces = torch.chunk(full, mesh.shape[a], d)
            i = mesh.coordinate[a]
            full = pieces[i] if i < len(pieces) else full.narrow(d, full.shape[d], 0)
    return full


def put_back(out, hits, block, spec, mesh):
    """Writes ``block`` where ``_layout`` says this rank's block lies (through the
    packed view) and counts the writes."""
    view_out, view_hits = _layout.view(out, spec), _layout.view(hits, spec)
    vspec = _layout.view_spec(spec)
    vblock = _layout.view(block, spec)     # a packed dim holds k slices, one per block
    lay = _layout.layout(vspec, view_out.ndim)
    idx = [slice(None)] * view_out.ndim
    for d, off, size in _layout.block_slices(view_out.shape, lay, mesh.shape, mesh.coordinate):
        idx[d] = slice(off, off + size)
    view_out[tuple(idx)] = vblock
    view_hits[tuple(idx)] += 1


def _cases(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        sizes, names = rng.choice(MESHES)
        mesh = FakeMesh(sizes, names)
        ndim = rng.randint(1, 3)
        shape = random_shape(rng, ndim)
        if rng.random() < 0.3:          # make packing possible on some dimension
            d = rng.randrange(ndim)
            shape = shape[:d] + (2 * math.prod(sizes) * rng.randint(1, 2),) + shape[d + 1:]
        spec = random_spec(rng, names, ndim, (shape, mesh.shape))
        try:
            _layout.check_packed("x", shape, spec, mesh)
        except ShardingError:
            continue
        yield mesh, shape, spec


def test_take_block_then_put_back_is_the_identity():
    seen_packed = seen_uneven = 0
    for mesh, shape, spec in _cases(0, 400):
        full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
        out, hits = torch.full(shape, -1.0, dtype=torch.float64), torch.zeros(shape)
        for c in mesh.coords():
            m = mesh.at(c)
            b = _layout.local_of(full, spec, m)
            lay = _layout.layout(spec, len(shape))
            if not spec.packed:
                assert tuple(b.shape) == _layout.local_shape(shape, lay, m), (shape, spec, c)
            assert torch.equal(b, chunk_reference(full, spec, m)), (shape, spec, c)
            put_back(out, hits, b, spec, m)
        assert torch.equal(out, full), (shape, spec, mesh)
        replicas = math.prod(s for a, s in mesh.shape.items() if a not in spec.axes)
        assert bool((hits == replicas).all()), (shape, spec, mesh, hits)
        seen_packed += bool(spec.packed)
        seen_uneven += not _layout.is_even(shape, _layout.layout(spec, len(shape)), mesh)
    assert seen_packed >= 20 and seen_uneven >= 50, (seen_packed, seen_uneven)


def _random_mesh(rng):
    sizes, names = rng.choice(MESHES)
    return FakeMesh(sizes, names), names, rng.randint(1, 3)


def test_local_and_global_shapes_round_trip():
    rng = random.Random(1)
    for _ in range(300):
        mesh, names, ndim = _random_mesh(rng)
        shape, spec = random_shape(rng, ndim), random_spec(rng, names, ndim)
        lay = _layout.layout(spec, ndim)
        coords = [dict(zip(names, c)) for c in mesh.coords()]
        assert coords == _layout.mesh_coordinates(mesh), (mesh, coords)
        locals_ = [_layout.local_shape(shape, lay, mesh.at(c)) for c in mesh.coords()]
        for d in range(ndim):
            got = _layout.size_from_blocks([s[d] for s in locals_], coords, lay[d], mesh.shape)
            assert got == shape[d], (shape, spec, mesh, d)
        # blocks summed over one group of ranks per dimension give the global size
        if _layout.is_even(shape, lay, mesh):
            assert _layout.even_global_shape(locals_[0], lay, mesh) == shape, (shape, spec, mesh)
            assert _layout.padded_shape(shape, lay, mesh) == shape, (shape, spec, mesh)
        else:
            assert _layout.uneven_dim(shape, lay, mesh.shape) is not None, (shape, spec, mesh)
            big = _layout.padded_shape(shape, lay, mesh)
            assert _layout.is_even(big, lay, mesh) and all(b >= n for b, n in zip(big, shape)), (
                shape, spec, mesh, big)
    # sizes that no torch.chunk layout gives: 3, 2, 2, 2 rows over 4 ranks
    m = FakeMesh((4,), ("x",))
    assert _layout.size_from_blocks([3, 2, 2, 2], _layout.mesh_coordinates(m), ("x",),
                                    m.shape) is None


def test_placements_round_trip():
    rng = random.Random(2)
    for _ in range(300):
        mesh, names, ndim = _random_mesh(rng)
        spec = _layout.mesh_order(random_spec(rng, names, ndim), ndim, mesh)
        place = _layout.spec_to_placements(spec, mesh, ndim, "test")
        back = _layout.placements_to_spec(place, names, "test")
        assert _layout.layout(back, ndim) == _layout.layout(spec, ndim), (spec, place, back)
        assert _layout.spec_to_placements(back, mesh, ndim, "test") == place, (spec, place, back)
        for a in names:
            want = next((Shard(d) for d in range(ndim) if a in spec.dim_axes(d)), Replicate())
            assert _layout.axis_placement(spec, a) == want, (spec, a, want)
    # placements -> spec -> placements, from random placement lists
    for _ in range(100):
        sizes, names = rng.choice(MESHES)
        mesh = FakeMesh(sizes, names)
        place = [Shard(rng.randrange(3)) if rng.random() < 0.6 else Replicate() for _ in names]
        spec = _layout.placements_to_spec(place, names, "test")
        assert _layout.spec_to_placements(spec, mesh, 3, "test") == place, (place, spec, mesh)


def test_axis_order_against_mesh_order_has_no_placements():
    mesh = FakeMesh((2, 2), ("a", "b"))
    with pytest.raises(ShardingError) as e:
        _layout.spec_to_placements(P(("b", "a")), mesh, 1, "where")
    for w in ["where", "P(('b', 'a'))", "mesh order", "P(('a', 'b'))"]:
        assert w in str(e.value), str(e.value)
    # an axis of size 1 splits nothing, so it may stand anywhere
    one = FakeMesh((1, 2), ("a", "b"))
    assert _layout.spec_to_placements(P(("b", "a")), one, 1, "w") == [Shard(0), Shard(0)]


def test_packed_views_and_slices():
    x = torch.arange(24.).reshape(8, 3)          # [gate; up], 4 rows each
    spec = P("x", None, packed={0: 2})
    assert _layout.view_spec(spec) == P(None, "x", None)
    assert _layout.view_shape((8, 3), spec) == (2, 4, 3)
    assert torch.equal(_layout.unview(_layout.view(x, spec), spec), x)
    # rank 1 of 2: rows 2-3 of gate and rows 6-7 of up
    assert torch.equal(_layout.packed_slice(x, 0, 2, 2, 1), x[[2, 3, 6, 7]])
    assert torch.equal(_layout.local_of(x, spec, FakeMesh((2,), ("x",), (1,))), x[[2, 3, 6, 7]])
    with pytest.raises(ShardingError, match="multiple of 8"):
        _layout.check_packed("w", (6, 3), P("x", packed={0: 2}), FakeMesh((4,), ("x",)))


def test_require_divisible_counts_packed_blocks():
    # 12 rows over 4 ranks divide, but as 2 packed blocks of 6 they do not: one check
    # and one message for both (the packed check was its own before)
    mesh, fix = FakeMesh((4,), ("x",)), "(fix: {k} and {n})"
    _layout.require_divisible("w", (12, 3), P("x", None), mesh, fix)
    with pytest.raises(ShardingError) as e:
        _layout.require_divisible("w", (12, 3), P("x", None, packed={0: 2}), mesh, fix)
    assert str(e.value) == (
        "w (shape (12, 3)): P('x', None, packed={0: 2}) splits dimension 0 of size 12 into "
        "2 packed blocks, each over ('x',) of size 4, which does not divide it; make it a "
        "multiple of 8 (fix: 8 and 4) (mesh FakeMesh({'x': 4}))"), str(e.value)
    _layout.require_divisible("w", (16, 3), P("x", None, packed={0: 2}), mesh, fix)
    # check_packed looks at the packed dimensions only: dimension 1 may be uneven
    _layout.check_packed("w", (16, 3), P("x", "y", packed={0: 2}), FakeMesh((4, 2), ("x", "y")))
    with pytest.raises(ShardingError, match="over \\('y',\\) of size 2, which does not divide"):
        _layout.require_divisible("w", (16, 3), P("x", "y", packed={0: 2}),
                                  FakeMesh((4, 2), ("x", "y")), fix)


# ---------------------------------------------------------------------------------
# through ranks: shard then unshard


def _shard_unshard_body(seed, count):
    mesh0 = None
    rng = random.Random(seed)
    world = functp.process_count()
    meshes = [(s, n) for s, n in MESHES if math.prod(s) == world]
    done = 0
    while done < count:
        sizes, names = rng.choice(meshes)
        mesh = functp.make_mesh(sizes, names)
        mesh0 = mesh0 or mesh
        ndim = rng.randint(1, 3)
        shape = random_shape(rng, ndim, hi=7)
        if rng.random() < 0.3:
            d = rng.randrange(ndim)
            shape = shape[:d] + (2 * world,) + shape[d + 1:]
        spec = random_spec(rng, names, ndim, (shape, mesh.shape))
        try:
            _layout.check_packed("x", shape, spec, mesh)
        except ShardingError:
            continue
        full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(done))
        local = functp.shard(full, mesh, spec)
        assert torch.equal(local, chunk_reference(full, spec, mesh)), (shape, spec)
        given = rng.random() < 0.5
        back = functp.unshard(local, mesh, spec, shapes=shape if given else None)
        assert torch.equal(back, full), (shape, spec, sizes)
        done += 1
    return done


@pytest.mark.parametrize("world", [2, 4, 8])
def test_shard_then_unshard_is_the_identity(run, world):
    assert run(world, _shard_unshard_body, world, 25) == [25] * world
