"""DTensor interop: blocks + specs <-> DTensor (even and uneven, nested axes), DTensor
arguments as global values for shard_map (dtensor_to_local), and the errors."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import functp
from functp import P, ShardingError
from functp.mapping._interop import dtensor_to_local
from _oracle import randn

GLOO = True     # run bodies on gloo processes: DTensor needs torch.distributed's default group

_CASES = [  # spec on mesh (dp, tp), its placements
    (P("dp", "tp"), [Shard(0), Shard(1)]),
    (P(("dp", "tp")), [Shard(0), Shard(0)]),
    (P(None, "tp"), [Replicate(), Shard(1)]),
    (P("tp", "dp"), [Shard(1), Shard(0)]),
    (P(), [Replicate(), Replicate()]),
]


def _round_trip_body():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    for shape in [(4, 8), (5, 3), (2, 3), (10, 1)]:          # even, uneven, tiny
        full = randn(*shape)
        for spec, placements in _CASES:
            local = functp.shard(full, mesh, spec)
            dt = functp.to_dtensor({"w": local, "n": 1}, mesh, {"w": spec, "n": P()})
            assert dt["n"] == 1 and isinstance(dt["w"], DTensor), (shape, spec, dt)
            assert list(dt["w"].placements) == placements and dt["w"].shape == full.shape, (
                shape, spec, dt["w"].placements, dt["w"].shape)
            # DTensor's own idea of where this block sits (what DCP uses) is functp's
            size, off = compute_local_shape_and_global_offset(full.shape, mesh.device_mesh,
                                                              placements)
            want = full[tuple(slice(o, o + n) for o, n in zip(off, size))]
            assert torch.equal(dt["w"].to_local(), want), (shape, spec)
            if all(n % 4 == 0 for n in shape):
                # (torch 2.13 gathers uneven nested shards wrongly once the mesh has
                # flattened groups, which functp's Mesh creates: even sizes only)
                assert torch.equal(dt["w"].full_tensor(), full), (shape, spec)
            # DTensor's own layout of the full value is functp's
            ref = distribute_tensor(full, mesh.device_mesh, placements)
            back, specs = functp.from_dtensor({"w": ref, "x": full, "n": 1})
            assert specs == {"w": spec, "x": P(), "n": P()}, specs
            assert torch.equal(back["w"], local) and back["x"] is full and back["n"] == 1, (
                shape, spec)
            # and the global shape given explicitly: no communication at all
            with functp.comm_log() as log:
                dt2 = functp.to_dtensor(local, mesh, spec, shapes=shape)
            assert len(log) == 0 and dt2.shape == full.shape, (shape, spec, log.events, dt2.shape)


def test_to_from_dtensor_round_trip(run):
    run(4, _round_trip_body)


def _one_process_body():
    mesh = functp.make_mesh((1,), ("x",))
    full = randn(3, 2)
    dt = functp.to_dtensor(full, mesh, P("x"))
    assert dt.placements == (Shard(0),) and torch.equal(dt.to_local(), full)
    local, spec = functp.from_dtensor(dt)
    assert spec == P("x") and torch.equal(local, full)


def test_one_process(run):
    run(1, _one_process_body)


def _shard_map_arg_body():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    full = randn(4, 8)
    dt = distribute_tensor(full, mesh.device_mesh, [Shard(0), Replicate()])
    # already laid out as asked: just the local block
    assert torch.equal(dtensor_to_local(dt, mesh, P("dp"), "args[0]"), functp.shard(full, mesh, P("dp")))
    # another layout: redistributed first
    for spec in [P(None, ("dp", "tp")), P("tp", "dp"), P()]:
        assert torch.equal(dtensor_to_local(dt, mesh, spec, "args[0]"),
                           functp.shard(full, mesh, spec)), spec
    # from an uneven layout to an even one
    six = randn(6, 4, seed=3)
    nested = functp.to_dtensor(functp.shard(six, mesh, P(("dp", "tp"))), mesh, P(("dp", "tp")))
    for spec in [P("dp"), P(None, ("tp", "dp"))]:
        assert torch.equal(dtensor_to_local(nested, mesh, spec, "a"),
                           functp.shard(six, mesh, spec)), spec
    # a Partial DTensor is reduced on the way
    part = DTensor.from_local(full / 4, mesh.device_mesh, [Partial(), Partial()], run_check=False)
    torch.testing.assert_close(dtensor_to_local(part, mesh, P("tp"), "args[1]"),
                               functp.shard(full, mesh, P("tp")), rtol=0, atol=1e-15)

    # errors: another mesh, uneven sizes, a nesting DTensor cannot express
    other = functp.make_mesh((4,), ("x",))
    on_other = distribute_tensor(full, other.device_mesh, [Shard(0)])
    with pytest.raises(ShardingError) as e:
        dtensor_to_local(on_other, mesh, P("dp"), "args[0]['w']")
    for w in ["args[0]['w']", "(4, 8)", "DTensor", "dp=2, tp=2"]:
        assert w in str(e.value), str(e.value)
    uneven = distribute_tensor(randn(5, 6), mesh.device_mesh, [Shard(0), Replicate()])
    with pytest.raises(ShardingError) as e:
        dtensor_to_local(uneven, mesh, P("dp"), "args[2]")
    for w in ["args[2]", "(5, 6)", "P('dp')", "pad_to_multiple"]:
        assert w in str(e.value), str(e.value)
    with pytest.raises(ShardingError) as e:
        functp.to_dtensor(functp.shard(full, mesh, P(("tp", "dp"))), mesh, P(("tp", "dp")))
    for w in ["P(('tp', 'dp'))", "mesh order", "P(('dp', 'tp'))"]:
        assert w in str(e.value), str(e.value)
    with pytest.raises(ShardingError, match="Partial"):
        functp.from_dtensor({"w": part})


def test_dtensor_as_shard_map_argument(run):
    run(4, _shard_map_arg_body)


def _dtensor_arg_body():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    full = randn(4, 8)
    dt = distribute_tensor(full, mesh.device_mesh, [Shard(0), Replicate()])
    total = functp.shard_map(lambda w: functp.psum((w ** 2).sum(), ("dp", "tp")), mesh,
                             in_specs=P(None, ("dp", "tp")), out_specs=P())
    got = total(dt)     # shard_map takes a DTensor as a global value: no escape hatch
    torch.testing.assert_close(got, (full ** 2).sum(), rtol=1e-12, atol=0)
    double = functp.shard_map(lambda w: w * 2, mesh, in_specs=P("tp"), out_specs=P("tp"))
    uneven = distribute_tensor(randn(5, 2), mesh.device_mesh, [Replicate(), Replicate()])
    with pytest.raises(ShardingError, match="pad_to_multiple"):
        double(uneven)
    # uneven plain blocks made by functp: the same clear error (no collective here)
    with pytest.raises(ShardingError, match="pad_to_multiple"):
        double(functp.shard(randn(5, 2), mesh, P("tp")))
    return "ok"


def test_shard_map_takes_dtensor_arguments(run):
    assert run(4, _dtensor_arg_body) == ["ok"] * 4


def _packed_refused():
    mesh = functp.make_mesh((2,), ("tp",))
    spec = P("tp", None, packed={0: 2})
    block = functp.shard(torch.arange(8.).reshape(4, 2), mesh, spec)
    with pytest.raises(ShardingError, match="packed blocks have no public DTensor placement"):
        functp.to_dtensor({"w": block}, mesh, {"w": spec})
    inside = functp.shard_map(lambda b: functp.reshard(b, mesh, spec, P()), mesh,
                              in_specs=spec, out_specs=P(), check_vma=False)
    with pytest.raises(ShardingError, match="packed layouts are resharded outside shard_map"):
        inside(block)


def test_packed_specs_are_refused_where_they_cannot_be_honoured(run):
    run(2, _packed_refused)
