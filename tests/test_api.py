"""P, functionalize, shard/unshard round trips, make_mesh and Mesh."""
from __future__ import annotations

import pickle

import pytest
import torch

import functp
from functp import P
from _oracle import assert_tree_close, randn


def test_partition_spec_entries():
    s = P("dp", None, ("tp", "sp"))
    assert len(s) == 3 and s.dim_axes(0) == ("dp",) and s.dim_axes(1) == ()
    assert s.dim_axes(2) == ("tp", "sp") and s.dim_axes(7) == () and s.axes == ("dp", "tp", "sp")
    assert repr(s) == "P('dp', None, ('tp', 'sp'))"
    assert pickle.loads(pickle.dumps(s)) == s and isinstance(pickle.loads(pickle.dumps(s)), P)
    with pytest.raises(functp.ShardingError, match="axis name"):
        P(3)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight          # tied

    def forward(self, ids):
        return self.head(self.bn(self.emb(ids)))


def test_functionalize_matches_module_and_keeps_ties():
    torch.manual_seed(0)
    net = _Net().eval()
    apply, params = functp.functionalize(net)
    assert sorted(params) == ["bn.bias", "bn.weight", "emb.weight"]
    ids = torch.tensor([1, 2, 3])
    torch.testing.assert_close(apply(params, ids), net(ids))
    # the tie holds in the functional call: one gradient, from both uses
    g = torch.func.grad(lambda p: apply(p, ids).sum())(params)
    ref = torch.autograd.grad(net(ids).sum(), net.emb.weight)[0]
    torch.testing.assert_close(g["emb.weight"], ref)


def test_functionalize_with_buffers():
    net = _Net().train()
    apply, params, buffers = functp.functionalize(net, with_buffers=True)
    assert sorted(buffers) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    mean = buffers["bn.running_mean"].clone()
    new = {k: v.clone() for k, v in buffers.items()}
    apply(params, new, torch.tensor([1, 2, 3, 4]))
    assert not torch.equal(new["bn.running_mean"], mean), "running stats land in the passed buffers"
    torch.testing.assert_close(buffers["bn.running_mean"], mean)


def _round_trip_body(shape, names):
    mesh = functp.make_mesh(shape, names)
    tree = {"a": randn(8, 12, seed=1), "b": [randn(4, seed=2), 3], "c": randn(2, 8, 4, seed=3)}
    specs = {"a": P(names[0], names[-1]) if len(names) > 1 else P(None, names[0]),
             "b": P(), "c": P(None, tuple(reversed(names)))}
    local = functp.shard(tree, mesh, specs)
    assert local["b"][1] == 3
    n0 = mesh.axis_size(tuple(reversed(names)))
    assert local["c"].shape == (2, 8 // n0, 4)
    assert_tree_close(functp.unshard(local, mesh, specs), tree, "unshard(shard(t))")
    # src_rank: only rank 0 holds the data
    src = functp.shard(tree if functp.process_index() == 0 else None, mesh, specs, src_rank=0)
    assert_tree_close(src, local, "shard(src_rank=0)")


@pytest.mark.parametrize("shape,names", [((2,), ("x",)), ((4,), ("x",)), ((2, 2), ("a", "b")),
                                         ((2, 4), ("a", "b"))])
def test_shard_unshard_round_trip(run, shape, names):
    import math
    run(math.prod(shape), _round_trip_body, shape, names)


def _mesh_body():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    assert functp.make_mesh((2, 2), ("dp", "tp")) is mesh, "meshes are cached"
    r = functp.process_index()
    assert mesh.shape == {"dp": 2, "tp": 2} and mesh.coordinate == {"dp": r // 2, "tp": r % 2}
    assert mesh.axis_index(("tp", "dp")) == (r % 2) * 2 + r // 2 and mesh.axis_size(("dp", "tp")) == 4
    wrapped = functp.Mesh.from_device_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("x",)))
    out = functp.shard_map(lambda x: functp.psum(x, "x"), wrapped, in_specs=P("x"),
                           out_specs=P())(torch.ones(1))
    return out.item()


def test_mesh_coordinates_and_from_device_mesh(run):
    assert run(4, _mesh_body, gloo=True) == [4.0] * 4     # DeviceMesh needs the default group


def test_one_process_mesh_needs_no_launcher():
    # make_mesh((1,)) starts a one-process group by itself: the unsharded reference
    # run of an example uses this
    import subprocess
    import sys
    code = ("import torch, functp; from functp import P\n"
            "m = functp.make_mesh((1,), ('x',))\n"
            "f = functp.shard_map(lambda x: functp.psum(x, 'x'), m, in_specs=P('x'), out_specs=P())\n"
            "print(f(torch.ones(3)).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items()
                              if k not in ("RANK", "WORLD_SIZE")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 1.0, 1.0]"
