"""Checkpoints over torch.distributed.checkpoint: saved on a (2, 2) mesh, loaded bit for
bit on (4,), (2,), (2, 2) with other specs and on one process; full_state_dict; and a
2-D training run (AdamW on local blocks) stopped and resumed on other meshes with the
losses of the uninterrupted run."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import functp
from functp import P, ShardingError
from _oracle import randn


def _full_tree():
    return {"params": {"emb": randn(10, 3, seed=1),      # uneven over 4 ranks
                       "w": randn(4, 8, seed=2),
                       "tiny": randn(2, 3, seed=3),      # more ranks than rows
                       "scale": randn((), seed=4)},
            "step": 7, "name": "run-1", "lr": [0.5, None]}


_SAVE_SPECS = {"params": {"emb": P(("dp", "tp")), "w": P("tp", "dp"), "tiny": P(("tp", "dp")),
                          "scale": P()},
               "step": P(), "name": P(), "lr": P()}


def _check(tree, mesh, specs):
    """``tree`` (loaded blocks) equals the blocks of the full tree, bit for bit."""
    want = functp.shard(_full_tree(), mesh, specs)
    for k, v in want["params"].items():
        assert tree["params"][k].dtype == v.dtype and torch.equal(tree["params"][k], v), k
    assert tree["step"] == 7 and tree["name"] == "run-1" and tree["lr"] == [0.5, None]


def _save_body(path):
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    full = _full_tree()
    local = functp.shard(full, mesh, _SAVE_SPECS)
    functp.save(path, local, mesh, _SAVE_SPECS)
    # and back on the same mesh, other specs
    specs = {"params": {"emb": P(None, "tp"), "w": P(("dp", "tp")), "tiny": P("dp"),
                        "scale": P()}, "step": P(), "name": P(), "lr": P()}
    _check(functp.load(path, mesh, specs), mesh, specs)
    # the full values on rank 0 only, in the tree's own keys
    sd = functp.full_state_dict(local["params"], mesh, _SAVE_SPECS["params"])
    if dist.get_rank() == 0:
        assert sorted(sd) == ["emb", "scale", "tiny", "w"]
        assert all(torch.equal(sd[k], full["params"][k]) for k in sd)
    else:
        assert sd is None


def _load_body(path, shape, names):
    mesh = functp.make_mesh(shape, names)
    a = names[0]
    specs = {"params": {"emb": P(a), "w": P(None, a), "tiny": P(a, None), "scale": P()},
             "step": P(), "name": P(), "lr": P()}
    _check(functp.load(path, mesh, specs), mesh, specs)
    # like= picks a subset (any placeholders will do)
    part = functp.load(path, mesh, {"params": {"w": P(a)}}, like={"params": {"w": 0}})
    assert torch.equal(part["params"]["w"], functp.shard(_full_tree()["params"]["w"], mesh, P(a)))
    with pytest.raises(ShardingError) as e:
        functp.load(path, mesh, P(), like={"params": {"v": 0}})
    assert "params.v" in str(e.value) and "like['params']['v']" in str(e.value)
    if dist.get_world_size() == 1:       # full tensors, no process group involved
        full = functp.load(path)
        _check(full, mesh, P())


@pytest.mark.parametrize("world,shape,names", [(4, (4,), ("x",)), (2, (2,), ("x",)),
                                               (1, (1,), ("x",))], ids=["4", "2", "1"])
def test_save_on_2x2_load_elsewhere(run, tmp_path, world, shape, names):
    path = str(tmp_path / "ckpt")
    run(4, _save_body, path)
    run(world, _load_body, path, shape, names)


# ---------------------------------------------------------------------------------
# stop a 2-D training run and resume it on another mesh

_SPECS = {"fc1.weight": P("tp", None), "fc1.bias": P("tp"),
          "fc2.weight": P(None, "tp"), "fc2.bias": P()}
_KEYS = sorted(_SPECS)


def _loss(p, x, y):
    h = torch.relu(x @ p["fc1.weight"].T + p["fc1.bias"])
    out = functp.psum(h @ p["fc2.weight"].T, "tp") + p["fc2.bias"]
    return functp.pmean(((out - y) ** 2).mean(), "dp")


def _opt_specs():
    return {"state": {i: {"step": P(), "exp_avg": _SPECS[k], "exp_avg_sq": _SPECS[k]}
                      for i, k in enumerate(_KEYS)}, "param_groups": P()}


def _train(mesh, params, opt, steps):
    x, y = randn(8, 4, seed=10), randn(8, 3, seed=11)
    xl, yl = functp.shard((x, y), mesh, P("dp"))
    step = functp.shard_map(_loss, mesh, in_specs=(_SPECS, P("dp"), P("dp")), out_specs=P())
    losses = []
    for _ in range(steps):
        grads, loss = torch.func.grad_and_value(step)(params, xl, yl)
        for k in _KEYS:
            params[k].grad = grads[k]
        opt.step()
        losses.append(loss.item())
    return losses


def _start(mesh):
    full = {"fc1.weight": randn(8, 4, seed=1), "fc1.bias": randn(8, seed=2),
            "fc2.weight": randn(3, 8, seed=3), "fc2.bias": randn(3, seed=4)}
    params = functp.shard(full, mesh, _SPECS)
    return params, torch.optim.AdamW([params[k] for k in _KEYS], lr=0.05, weight_decay=0.1)


def _resume(path, mesh):
    state = functp.load(path, mesh, {"params": _SPECS, "opt": _opt_specs()})
    params = state["params"]
    opt = torch.optim.AdamW([params[k] for k in _KEYS], lr=0.05, weight_decay=0.1)
    opt.load_state_dict(state["opt"])
    return params, opt


def _train_body(path):
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    reference = _train(mesh, *_start(mesh), 5)
    params, opt = _start(mesh)
    first = _train(mesh, params, opt, 2)
    assert first == reference[:2]
    functp.save(path, {"params": params, "opt": opt.state_dict()}, mesh,
                {"params": _SPECS, "opt": _opt_specs()})
    resumed = {}
    for shape in [(2, 2), (1, 4), (4, 1)]:       # the same mesh, tp=4, dp=4
        m = functp.make_mesh(shape, ("dp", "tp"))
        resumed[shape] = _train(m, *_resume(path, m), 3)
    return reference, resumed


def _resume_body(path, shape):
    mesh = functp.make_mesh(shape, ("dp", "tp"))
    return _train(mesh, *_resume(path, mesh), 3)


def test_training_resumes_on_another_mesh(run, tmp_path):
    path = str(tmp_path / "train")
    reference, resumed = run(4, _train_body, path)[0]
    assert resumed[(2, 2)] == reference[2:], "the same mesh: bit-identical losses"
    for shape in [(1, 4), (4, 1)]:
        torch.testing.assert_close(resumed[shape], reference[2:], rtol=1e-12, atol=1e-14)
    # and on fewer processes
    for shape in [(1, 2), (2, 1)]:
        torch.testing.assert_close(run(2, _resume_body, path, shape)[0], reference[2:],
                                   rtol=1e-12, atol=1e-14)
    assert reference[4] < reference[0]
