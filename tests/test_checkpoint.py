"""Checkpoints over torch.distributed.checkpoint: saved on a (2, 2) mesh, loaded bit for
bit on (4,), (2,), (2, 2) with other specs and on one process; full_state_dict; and a
2-D training run (AdamW on local blocks) stopped and resumed on other meshes with the
losses of the uninterrupted run; and checkpoints that cannot load wrong: damaged,
truncated, missing or half-written ones, like= leaves that do not fit and failed saves
raise the same CheckpointError on every rank, in seconds."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import functp
from functp import P, ShardingError
from _oracle import randn

GLOO = True     # run bodies on gloo processes: DCP needs torch.distributed's default group


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


# ---------------------------------------------------------------------------------
# checkpoints that cannot load wrong: every rank raises the same CheckpointError, fast

_SMALL_SPECS = {"w": P("x"), "b": P(), "step": P()}


def _small():
    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": randn(8, seed=5),
            "step": 3}


def _mesh2():
    return functp.make_mesh((2,), ("x",))


def _save_small(path):
    mesh = _mesh2()
    functp.save(path, functp.shard(_small(), mesh, _SMALL_SPECS), mesh, _SMALL_SPECS)


def _outcome(fn):
    """``(error type, message, seconds)`` of ``fn()``'s failure; ``None`` if it did not fail."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:       # noqa: BLE001 - the driver asserts on it
        return type(e).__name__, str(e), time.monotonic() - t0
    return None


def _try_load(path, kw):
    specs = P() if "like" in kw else _SMALL_SPECS
    return _outcome(lambda: functp.load(path, _mesh2(), specs, **kw))


def _try_load_full(path, kw):
    return _outcome(lambda: functp.load(path, **kw))


def _all_raise(outcomes, *words, kind="CheckpointError"):
    """Every rank raised ``kind`` within 30 s, its first line holding ``words``."""
    for rank, out in enumerate(outcomes):
        assert out is not None, f"rank {rank} did not fail"
        name, msg, secs = out
        first = msg.split("\n")[0]
        assert name == kind, (rank, name, msg)
        for w in words:
            assert w in first, f"rank {rank}: {w!r} not in the first line of: {msg}"
        assert secs < 30, (rank, secs)
        assert "tensor(" not in msg, msg
    return [o[1] for o in outcomes]


def test_checkpoint_error_is_a_sharding_error():
    assert issubclass(functp.CheckpointError, functp.ShardingError)
    assert issubclass(functp.CheckpointError, Exception)
    assert "CheckpointError" in functp.__all__


def _block_bytes(t):
    return bytes(t.contiguous().view(torch.uint8).flatten().tolist())


def _flip_in_data(path, fqn, data):
    """Flips 4 bytes inside ``data`` (a stored block's raw bytes) where rank 0's file
    stores ``fqn``: tensor values, not torch.save's zip records, so DCP alone would
    load them silently. Returns the file's name."""
    meta = dcp.FileSystemReader(path).read_metadata()
    (info,) = [s for i, s in meta.storage_data.items()
               if i.fqn == fqn and s.relative_path.startswith("__0_")]
    file = os.path.join(path, info.relative_path)
    raw = bytearray(open(file, "rb").read())
    at = raw.find(data, info.offset, info.offset + info.length)
    assert at >= 0, "the block's bytes are stored as they are"
    at += len(data) // 2
    raw[at:at + 4] = bytes(b ^ 0xFF for b in raw[at:at + 4])
    with open(file, "wb") as f:
        f.write(raw)
    return info.relative_path


def test_corrupted_bytes_raise_on_every_rank(run, tmp_path):
    path = str(tmp_path / "ckpt")
    run(2, _save_small, path)
    w = _small()["w"]
    file = _flip_in_data(path, "w", _block_bytes(w[:4]))
    # DCP alone reads the damaged values without a word
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = {"w": torch.empty(8, 8)}
        dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert not torch.equal(plain["w"], w)
    _all_raise(run(2, _try_load, path, {}), "'w'", file, path, "corrupted")
    _all_raise(run(1, _try_load_full, path, {}), "'w'", file, path, "corrupted")
    # keys not asked for are not read, so not checked: a subset still loads
    assert run(2, _try_load, path, {"like": {"b": 0}}) == [None, None]


def test_truncated_metadata(run, tmp_path):
    path = str(tmp_path / "ckpt")
    run(2, _save_small, path)
    meta = os.path.join(path, ".metadata")
    raw = open(meta, "rb").read()
    with open(meta, "wb") as f:
        f.write(raw[:len(raw) // 2])
    _all_raise(run(2, _try_load, path, {}), ".metadata is unreadable", path)
    # without the checksum of .metadata: unpickling it fails, with the same message
    os.remove(os.path.join(path, ".functp_checksums.json"))
    _all_raise(run(2, _try_load, path, {}), ".metadata is unreadable", path)
    _all_raise(run(1, _try_load_full, path, {}), ".metadata is unreadable", path)


def test_missing_checkpoint(run, tmp_path):
    path = str(tmp_path / "nowhere")
    _all_raise(run(2, _try_load, path, {}), f"no checkpoint at {path}")
    _all_raise(run(1, _try_load_full, path, {}), f"no checkpoint at {path}")


def test_interrupted_save_is_incomplete(run, tmp_path):
    path = str(tmp_path / "ckpt")
    run(2, _save_small, path)
    os.remove(os.path.join(path, ".functp_checksums.json"))   # the save stopped before it
    _all_raise(run(2, _try_load, path, {}), "incomplete", "did not finish", path)
    _all_raise(run(1, _try_load_full, path, {}), "incomplete", path)
    _all_raise(run(2, _try_load, path, {"like": {"w": 0}}), "incomplete", path)


def _save_as_older_functp(path, checksummed):
    """What functp.save wrote before its tree file (format 1): the blocks, and the tree
    structure and non-tensor leaves pickled into DCP; and, once it wrote checksums,
    their file and a mark saying it has them."""
    import optree
    mesh = _mesh2()
    local = functp.shard(_small(), mesh, _SMALL_SPECS)
    dtensors = {"w": functp.to_dtensor(local["w"], mesh, _SMALL_SPECS["w"]),
                "b": local["b"], "step": 3,
                "__functp_treespec__": optree.tree_structure(_small())}
    if checksummed:
        dtensors["__functp_checksummed__"] = 1
    dcp.save(dtensors, checkpoint_id=path)
    dist.barrier()
    if checksummed and dist.get_rank() == 0:
        _write_sums(path, _honest_metadata(path))


def _honest_metadata(path):
    """The metadata of a checkpoint this test wrote itself (so unpickling it is fine)."""
    import pickle
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def _write_metadata(path, meta):
    import pickle
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _write_sums(path, meta):
    """A checksum file for the folder as it is now (what a forger can do too)."""
    import json
    import zlib

    def crc(name, start=0, length=None):
        with open(os.path.join(path, name), "rb") as f:
            f.seek(start)
            return zlib.crc32(f.read(length))
    record = {"metadata": crc(".metadata"), "entries": [
        [i.fqn, None if i.offset is None else list(i.offset), s.relative_path, s.offset,
         s.length, crc(s.relative_path, s.offset, s.length)]
        for i, s in meta.storage_data.items()]}
    if os.path.exists(os.path.join(path, ".functp_tree.json")):
        record["tree"] = crc(".functp_tree.json")
    with open(os.path.join(path, ".functp_checksums.json"), "w") as f:
        json.dump(record, f)


def _load_older(path):
    mesh = _mesh2()
    want = functp.shard(_small(), mesh, _SMALL_SPECS)

    def same(t):
        return (sorted(t) == ["b", "step", "w"] and all(torch.equal(t[k], want[k]) for k in "wb")
                and type(t["step"]) is int and t["step"] == 3)
    # like= gives the structure; the pickled step counter is read as plain data
    with_like = functp.load(path, mesh, _SMALL_SPECS, like={"w": 0, "b": 0, "step": 0})
    # the structure alone is a pickle: refused, with the way to convert the folder once
    refused = _outcome(lambda: functp.load(path, mesh, _SMALL_SPECS))
    trusted = functp.load(path, mesh, _SMALL_SPECS, trusted=True)
    functp.save(path + "-new", trusted, mesh, _SMALL_SPECS)
    converted = functp.load(path + "-new", mesh, _SMALL_SPECS)
    return same(with_like), same(trusted), same(converted), refused


@pytest.mark.parametrize("checksummed", [False, True], ids=["unchecked", "checksummed"])
def test_checkpoint_of_an_older_functp_loads(run, tmp_path, checksummed):
    path = str(tmp_path / "ckpt")
    run(2, _save_as_older_functp, path, checksummed)
    results = run(2, _load_older, path)
    assert [r[:3] for r in results] == [(True, True, True)] * 2, results
    msgs = _all_raise([r[3] for r in results], "written by an older functp", path)
    assert all("like=" in m and "trusted=True" in m for m in msgs), msgs


def _save_fails_on_rank1(path, how):
    mesh = _mesh2()
    local = functp.shard(_small(), mesh, _SMALL_SPECS)
    if how == "shapes":       # rank 1 alone finds its block does not fit: before DCP starts
        shapes = {"w": (8, 8) if dist.get_rank() == 0 else (7, 8), "b": (8,), "step": None}
        return _outcome(lambda: functp.save(path, local, mesh, _SMALL_SPECS, shapes=shapes))

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device (simulated)")
    writer = dcp.FileSystemWriter
    if dist.get_rank() == 1:  # rank 1's write fails in the middle of DCP's steps
        writer.write_data = full_disk
    try:
        return _outcome(lambda: functp.save(path, local, mesh, _SMALL_SPECS))
    finally:
        if "write_data" in writer.__dict__:
            del writer.write_data


def test_failed_save_raises_the_cause_on_every_rank(run, tmp_path):
    path = str(tmp_path / "ckpt")
    run(2, _save_small, path)
    # a preparation that fails on one rank: that rank's error, the other names it
    (name0, msg0, _), (name1, msg1, _) = run(2, _save_fails_on_rank1, path, "shapes")
    assert name1 == "ShardingError" and "(7, 8)" in msg1, msg1
    assert name0 == "CheckpointError" and "rank 1 failed" in msg0 and "(7, 8)" in msg0, msg0
    assert run(2, _try_load, path, {}) == [None, None], "nothing written: the old one loads"
    # a write that fails on rank 1: the real cause on every rank, and no complete checkpoint
    _all_raise(run(2, _save_fails_on_rank1, path, "disk"),
               "OSError", "No space left on device (simulated)", "on rank 1", path)
    _all_raise(run(2, _try_load, path, {}), "incomplete", path)
    # DCP cannot make the directory: its error, not "CheckpointException ranks:..."
    afile = str(tmp_path / "afile")
    open(afile, "w").close()
    msgs = _all_raise(run(2, _try_save, afile), "FileExistsError", afile)
    assert not any("CheckpointException ranks" in m.split("\n")[0] for m in msgs)


def _try_save(path):
    mesh = _mesh2()
    return _outcome(lambda: functp.save(path, functp.shard(_small(), mesh, _SMALL_SPECS),
                                        mesh, _SMALL_SPECS))


def _like_body(path):
    mesh = _mesh2()
    want = functp.shard(_small(), mesh, _SMALL_SPECS)["w"]
    # this mesh's block, or the full tensor: both fit
    for like in (torch.zeros(4, 8), torch.zeros(8, 8)):
        got = functp.load(path, mesh, {"w": P("x")}, like={"w": like})["w"]
        assert got.dtype == torch.float32 and torch.equal(got, want), (tuple(like.shape), got)
    got = functp.load(path, mesh, {"w": P("x")}, like={"w": torch.zeros(4, 8, dtype=torch.float64)},
                      convert=True)["w"]
    assert got.dtype == torch.float64 and torch.equal(got, want.double())
    load = lambda like, **kw: functp.load(path, mesh, {"w": P("x")}, like={"w": like}, **kw)
    rank1_only = torch.zeros(4 if dist.get_rank() == 0 else 5, 8)
    return (_outcome(lambda: load(torch.zeros(3, 8))),
            _outcome(lambda: load(torch.zeros(4, 8, dtype=torch.float64))),
            _outcome(lambda: load(torch.zeros(3, 8, dtype=torch.float64), convert=True)),
            _outcome(lambda: load(rank1_only)))


def test_like_checks_shape_and_dtype(run, tmp_path):
    path = str(tmp_path / "ckpt")
    run(2, _save_small, path)
    shape, dtype, convert, one_rank = zip(*run(2, _like_body, path))
    for msgs in (_all_raise(shape, "like['w']", "(3, 8)", "'w'", "(8, 8)", "(4, 8)", path),
                 _all_raise(convert, "like['w']", "(3, 8)", "(8, 8)")):
        assert all("placeholder" in m for m in msgs), msgs
    msgs = _all_raise(dtype, "like['w']", "torch.float64", "torch.float32", path)
    assert all("convert=True" in m for m in msgs)
    # a leaf that does not fit on rank 1 alone: rank 0 does not wait, it names rank 1
    assert one_rank[1][0] == "CheckpointError" and "(5, 8)" in one_rank[1][1]
    assert one_rank[0][0] == "CheckpointError" and "rank 1 failed" in one_rank[0][1]
    assert "(5, 8)" in one_rank[0][1].split("\n")[0] and all(o[2] < 30 for o in one_rank)


def _without_numpy(path):
    real = sys.modules.get("numpy")
    sys.modules["numpy"] = None          # what importlib sees when numpy is not installed
    try:
        return (_try_save(path), _try_load(path, {}))
    finally:
        sys.modules["numpy"] = real


def test_without_numpy(run, tmp_path):
    path = str(tmp_path / "ckpt")
    run(2, _save_small, path)
    saves, loads = zip(*run(2, _without_numpy, path))
    _all_raise(saves, "functp.save needs numpy", "pip install numpy")
    _all_raise(loads, "functp.load needs numpy", "pip install numpy")
    assert run(2, _try_load, path, {}) == [None, None], "the ranks are still in step"
    # one process reads without DCP's collectives: numpy is not needed
    script = ("import sys, warnings; sys.modules['numpy'] = None; warnings.simplefilter('ignore');"
              "import torch, functp; t = functp.load(sys.argv[1]);"
              "assert torch.equal(t['w'], torch.arange(64.).reshape(8, 8)) and t['step'] == 3")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script, path], check=True, env=env, timeout=120)



def _optimizer_specs_body(path):
    """optimizer_specs gives the spec tree _opt_specs builds by hand (by parameter
    index), and a save/load with it resumes on another mesh."""
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    params, opt = _start(mesh)
    _train(mesh, params, opt, 1)
    specs = functp.optimizer_specs(opt, params, _SPECS)
    assert specs == _opt_specs(), specs
    functp.save(path, {"params": params, "opt": opt.state_dict()}, mesh,
                {"params": _SPECS, "opt": specs})
    mesh4 = functp.make_mesh((1, 4), ("dp", "tp"))
    state = functp.load(path, mesh4, {"params": _SPECS, "opt": _opt_specs()})
    want = functp.shard(functp.unshard(opt.state_dict()["state"][0]["exp_avg"], mesh,
                                       _SPECS[_KEYS[0]]), mesh4, _SPECS[_KEYS[0]])
    return torch.equal(state["opt"]["state"][0]["exp_avg"], want)


def test_optimizer_specs_from_parameter_specs(run, tmp_path):
    assert run(4, _optimizer_specs_body, str(tmp_path / "ckpt")) == [True] * 4


def _set_grads_errors():
    p = {"w": torch.zeros(2, 3, requires_grad=True)}
    functp.set_grads(p, {"w": torch.ones(2, 3, dtype=torch.float64)})
    assert p["w"].grad.dtype == torch.float32
    with pytest.raises(ShardingError, match="no gradient for"):
        functp.set_grads(p, {})
    with pytest.raises(ShardingError, match=r"shape \(3,\)"):
        functp.set_grads(p, {"w": torch.ones(3)})


def test_set_grads(run):
    run(1, _set_grads_errors)


# -- packed weights: a checkpoint of a fused gate_up loads on any mesh ----------------------

_STEPS, _SAVE_AT = 20, 10


def _llama(mesh):
    from functp.models import LLAMA_MOE_SP_PLAN, Llama, LlamaConfig
    torch.manual_seed(0)
    model = Llama(LlamaConfig(moe_layers=(1,)))       # a fused gate_up and experts
    if mesh is None:
        return model, None, None, None
    apply, params, specs = functp.parallelize(model, mesh, LLAMA_MOE_SP_PLAN, axis="tp")
    return model, apply, {k: v.clone() for k, v in params.items()}, specs


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    b = torch.randint(32, (8, 9), generator=g)
    return b[:, :-1], b[:, 1:]


def _lm(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _steps(mesh, apply, specs, params, opt, steps):
    if mesh is None:            # one process: the plain model
        step = torch.func.grad_and_value(lambda p, i, t: _lm(apply(p, i), t))
    else:
        step = torch.func.grad_and_value(functp.shard_map(
            lambda p, i, t: functp.pmean(_lm(apply(p, i), t), "dp"), mesh,
            in_specs=(specs, P("dp"), P("dp")), out_specs=P()))
    losses = []
    for i in steps:
        ids, tgt = _batch(i)
        batch = (ids, tgt) if mesh is None else functp.shard((ids, tgt), mesh, P("dp"))
        grads, loss = step(params, *batch)
        functp.set_grads(params, grads)
        opt.step()
        losses.append(loss.item())
    return losses


def _adam(params):
    return torch.optim.AdamW(list(params.values()), lr=1e-2)


def _opt_specs_of(params, specs):    # AdamW's state, before it exists (for load)
    return {"state": {i: {"step": P(), "exp_avg": specs[k], "exp_avg_sq": specs[k]}
                      for i, k in enumerate(params)}, "param_groups": P()}


def _packed_resume_body(path):
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, _, _, _ = _llama(None)
        ref_apply, full = functp.functionalize(model)
        full = {k: v.clone() for k, v in full.items()}
        reference = _steps(None, ref_apply, None, full, _adam(full), range(_STEPS))

        mesh = functp.make_mesh((2, 2), ("dp", "tp"))
        _, apply, local, specs = _llama(mesh)
        packed = sorted(k for k, s in specs.items() if s.packed)
        opt = _adam(local)
        first = _steps(mesh, apply, specs, local, opt, range(_SAVE_AT))
        functp.save(path, {"params": local, "opt": opt.state_dict()}, mesh,
                    {"params": specs, "opt": functp.optimizer_specs(opt, local, specs)})
        resumed = {}
        for shape in [(2, 2), (1, 4), (4, 1)]:          # the same mesh, tp=4, dp=4
            m = functp.make_mesh(shape, ("dp", "tp"))
            _, apply_m, fresh, specs_m = _llama(m)
            state = functp.load(path, m, {"params": specs_m,
                                          "opt": _opt_specs_of(fresh, specs_m)})
            opt_m = _adam(state["params"])
            opt_m.load_state_dict(state["opt"])
            resumed[shape] = _steps(m, apply_m, specs_m, state["params"], opt_m,
                                    range(_SAVE_AT, _STEPS))
        # and on one process, no mesh: the plain model from the canonical tensors
        whole = functp.load(path) if functp.process_index() == 0 else None
        one = None
        if whole is not None:
            opt_1 = _adam(whole["params"])
            opt_1.load_state_dict(whole["opt"])
            one = _steps(None, ref_apply, None, whole["params"], opt_1, range(_SAVE_AT, _STEPS))
        return packed, reference, first, resumed, one
    finally:
        torch.set_default_dtype(dtype)


def test_packed_weights_and_their_adam_moments_resume_on_any_mesh(run, tmp_path):
    packed, reference, first, resumed, one = run(4, _packed_resume_body,
                                                 str(tmp_path / "packed"))[0]
    assert "layers.0.mlp.gate_up_proj.weight" in packed, packed
    torch.testing.assert_close(first, reference[:_SAVE_AT], rtol=1e-9, atol=0)
    for shape, losses in list(resumed.items()) + [("one process", one)]:
        torch.testing.assert_close(losses, reference[_SAVE_AT:], rtol=1e-8, atol=0,
                                   msg=lambda m: f"resumed on {shape}: {m}")
    assert reference[-1] < reference[0]


# -- a folder from someone else: loading it runs nothing from it ---------------------------


class _Payload:
    """Unpickling it calls ``os.mkdir(marker)``: what a crafted file would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


_MKDIR = f"{os.mkdir.__module__}.mkdir"        # the global its pickle names


@pytest.mark.parametrize("sums", ["removed", "recomputed"])
def test_metadata_that_would_run_code_is_refused(run, tmp_path, sums):
    path, marker = str(tmp_path / "ckpt"), str(tmp_path / "ran")
    run(2, _save_small, path)
    meta = _honest_metadata(path)
    meta.planner_data = _Payload(marker)
    _write_metadata(path, meta)
    if sums == "removed":
        os.remove(os.path.join(path, ".functp_checksums.json"))
    else:
        _write_sums(path, meta)
    for outcomes in (run(2, _try_load, path, {}), run(2, _try_load, path, {"like": {"b": 0}}),
                     run(1, _try_load_full, path, {})):
        msgs = _all_raise(outcomes, ".metadata was refused", _MKDIR, "nothing from it was run",
                          path)
        assert all("trusted=True" in m for m in msgs), msgs
    assert not os.path.exists(marker), "functp.load ran the payload"
    # the payload is live: DCP's own reader runs it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.FileSystemReader(path).read_metadata()
    assert os.path.isdir(marker)


def _save_plain_dcp(path, values, marker=None):
    """A checkpoint written by torch.distributed.checkpoint.save itself, on 2 ranks: ``w``
    split, ``b`` whole, and the non-tensor ``values`` (with ``marker``: a step counter
    whose pickle makes that directory; built here, as unpickling it would run it)."""
    if marker is not None:
        values = {**values, "step": _Payload(marker)}
    mesh = _mesh2()
    local = functp.shard(_small(), mesh, _SMALL_SPECS)
    dcp.save({"w": functp.to_dtensor(local["w"], mesh, P("x")), "b": local["b"], **values},
             checkpoint_id=path)


def _load_plain_dcp(path, like):
    mesh = _mesh2()
    got = functp.load(path, mesh, {"w": P("x"), "b": P(), "step": P(), "name": P()}, like=like)
    want = functp.shard(_small(), mesh, _SMALL_SPECS)
    return ([torch.equal(got[k], want[k]) for k in "wb"], {k: got[k] for k in got if k not in "wb"},
            _outcome(lambda: functp.load(path, mesh, P())))


def test_a_checkpoint_of_dcp_itself_loads_exactly(run, tmp_path):
    path = str(tmp_path / "ckpt")
    run(2, _save_plain_dcp, path, {"step": 7, "name": "run-1"})
    like = {"w": 0, "b": 0, "step": 0, "name": 0}
    for same, values, no_tree in run(2, _load_plain_dcp, path, like):
        assert same == [True, True] and values == {"step": 7, "name": "run-1"}, (same, values)
        assert no_tree[0] == "CheckpointError" and "pass like=" in no_tree[1], no_tree
    with warnings.catch_warnings():                # DCP: "assuming ... a single process"
        warnings.simplefilter("ignore")
        full = functp.load(path, like=like)       # one process, no mesh
    assert torch.equal(full["w"], _small()["w"]) and torch.equal(full["b"], _small()["b"])
    assert (full["step"], full["name"]) == (7, "run-1")


def _try_load_like(path, like):
    mesh = _mesh2()
    return _outcome(lambda: functp.load(path, mesh, P(), like=like))


def test_a_value_that_would_run_code_is_refused(run, tmp_path):
    path, marker = str(tmp_path / "ckpt"), str(tmp_path / "ran")
    run(2, _save_plain_dcp, path, {}, marker)
    assert not os.path.exists(marker)
    for outcomes in (run(2, _try_load_like, path, {"w": 0, "b": 0, "step": 0}),
                     run(1, _try_load_full, path, {"like": {"step": 0}})):
        _all_raise(outcomes, "key 'step' was refused", _MKDIR, "nothing from it was run", path)
    assert not os.path.exists(marker), "functp.load ran the payload"
    assert run(2, _try_load_like, path, {"w": 0, "b": 0}) == [None, None], "the rest loads"
    # the payload is live: DCP's own planner runs it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"step": None}, checkpoint_id=path, no_dist=True)
    assert os.path.isdir(marker)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "metadata-link"])
def test_files_outside_the_folder_are_refused(run, tmp_path, how):
    import shutil
    path, outside = str(tmp_path / "ckpt"), tmp_path / "outside"
    run(2, _save_small, path)
    meta = _honest_metadata(path)
    outside.mkdir()
    # rank 1's block of w (or DCP's metadata), moved out of the folder
    moved = ".metadata" if how == "metadata-link" else "__1_0.distcp"
    shutil.copy(os.path.join(path, moved), outside / moved)
    os.remove(os.path.join(path, moved))
    if how.endswith("link"):                  # the same bytes: its checksums still pass
        os.symlink(outside / moved, os.path.join(path, moved))
        named = moved
    else:
        named = f"../outside/{moved}" if how == "dotdot" else str(outside / moved)
        for info in meta.storage_data.values():
            if info.relative_path == moved:
                info.relative_path = named
        _write_metadata(path, meta)
        _write_sums(path, meta)
    # DCP itself reads the file outside the folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = {"w": torch.empty(8, 8)}
        dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert torch.equal(plain["w"], _small()["w"])
    words = ((".metadata is a link that leaves the checkpoint folder",) if moved == ".metadata"
             else (repr(named), "outside the checkpoint folder"))
    for outcomes in (run(2, _try_load, path, {}), run(2, _try_load, path, {"like": {"b": 0}}),
                     run(1, _try_load_full, path, {})):
        _all_raise(outcomes, *words, path)


@pytest.mark.parametrize("forged", [{"step": {"pickle": "gASVAAAA"}}, {"step": {"dtype": "Tensor"}},
                                    {"w": 3}], ids=["unknown-tag", "not-a-dtype", "a-tensor-key"])
def test_a_forged_tree_file_is_refused(run, tmp_path, forged):
    import json
    path = str(tmp_path / "ckpt")
    run(2, _save_small, path)
    file = os.path.join(path, ".functp_tree.json")
    with open(file) as f:
        record = json.load(f)
    record["values"].update(forged)
    if "w" in forged:      # a value under a key whose tensor .metadata holds
        record["tree"]["dict"] = [[k, {"value": k} if k == "w" else n]
                                  for k, n in record["tree"]["dict"]]
    with open(file, "w") as f:
        json.dump(record, f)
    _write_sums(path, _honest_metadata(path))
    _all_raise(run(2, _try_load, path, {}), ".functp_tree.json is unreadable", path)


def _tree_of_values():
    from collections import OrderedDict
    return {"w": torch.arange(6.).reshape(2, 3),
            "meta": {"step": 7, "big": -2 ** 70, "lr": 0.1, "neg0": -0.0, "inf": float("inf"),
                     "nan": float("nan"), "c": 1 - 2j, "name": "run-1", "raw": b"\x00\xff",
                     "flag": True, "dtype": torch.bfloat16, "device": torch.device("cpu"),
                     "size": torch.Size([2, 3]), "pair": (1, [2.5, None]),
                     "ordered": OrderedDict(z=1, y="b"), "by_int": {3: "three", 1: "one"}}}


def _values_body(path):
    mesh = _mesh2()
    tree = _tree_of_values()
    functp.save(path, tree, mesh, P())
    got = functp.load(path, mesh, P())
    whole = functp.load(path)
    refused = _outcome(lambda: functp.save(path + "-obj", {"x": object()}, mesh, P()))
    return ([repr(t["meta"]) for t in (got, whole)], [torch.equal(t["w"], tree["w"])
                                                      for t in (got, whole)], refused)


def test_non_tensor_leaves_are_stored_as_data(run, tmp_path):
    import json
    import optree
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    path = str(tmp_path / "ckpt")
    want = _tree_of_values()
    for reprs, same, refused in run(2, _values_body, path):
        assert reprs == [repr(want["meta"])] * 2 and same == [True, True], reprs
        assert refused[0] == "CheckpointError" and "tree['x']" in refused[1], refused
        assert "object" in refused[1] and "never as a pickle" in refused[1], refused
    # the folder holds tensors and JSON, nothing pickled beside DCP's own metadata
    meta = _honest_metadata(path)
    assert all(isinstance(m, TensorStorageMetadata) for m in meta.state_dict_metadata.values())
    with open(os.path.join(path, ".functp_tree.json")) as f:
        assert json.load(f)["values"]["meta.name"] == "run-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert optree.tree_structure(functp.load(path)) == optree.tree_structure(want)


def _namedtuple_body(path):
    import collections
    Pair = collections.namedtuple("Pair", "a b")
    mesh = _mesh2()
    functp.save(path, Pair(torch.ones(2), 3), mesh, P())
    got = functp.load(path, mesh, P(), like=Pair(0, 0))
    return (type(got) is Pair and torch.equal(got.a, torch.ones(2)) and got.b == 3,
            _outcome(lambda: functp.load(path, mesh, P())))


def test_a_tree_of_other_nodes_loads_with_like(run, tmp_path):
    # a namedtuple's class is code: the file keeps its leaves, like= gives the structure
    for ok, no_like in run(2, _namedtuple_body, str(tmp_path / "ckpt")):
        assert ok, "the namedtuple did not load back as a Pair of its leaves with like="
        assert no_like[0] == "CheckpointError" and "Pair" in no_like[1], no_like
        assert "pass like=" in no_like[1], no_like


def test_the_allowlist_admits_what_dcp_writes(tmp_path):
    """Every dtype and layout DCP records, as torch (this one) writes them."""
    import pickle
    from functp.io import _safe_pickle
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
              torch.complex64, torch.complex128, torch.float8_e4m3fn]
    state = {str(d): torch.zeros(2, 3, dtype=d) for d in dtypes}
    state["cl"] = torch.zeros(1, 2, 3, 4).to(memory_format=torch.channels_last)
    state["step"], state["name"] = 7, "run-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    raw = open(tmp_path / ".metadata", "rb").read()
    assert _safe_pickle.load_metadata(raw) == pickle.loads(raw)


# -- ranks that save different trees: refused, with the check mode or without -----------------

def _stage_tree(stage: int, odd: str = "") -> tuple[dict, dict]:
    """A pipeline stage's tree (stage 0 layers 0-1 and the embedding, stage 1 layers
    2-3 and the head), and its specs; ``odd``: one way to make the stages' union no
    checkpoint. (Split leaves of a stage: the transformers case, on pp x tp.)"""
    layers = [0, 1] if stage == 0 else [2, 3]
    tree = {"params": {f"layers.{i}.w": randn(2, seed=i) for i in layers},
            "step": 7 if odd != "value" or stage == 0 else 8}
    specs = {"params": {k: P() for k in tree["params"]}, "step": P()}
    first = "embed" if stage == 0 else "head"
    if odd == "opt":                   # an optimizer's state numbered from 0 per stage
        tree["params"]["state.0.exp_avg"] = randn(2 + stage, seed=9)
        specs["params"]["state.0.exp_avg"] = P()
    tree["params"][first] = randn(4 if first == "embed" else 2, seed=5 + stage)
    specs["params"][first] = P()
    if odd == "half" and stage == 0:   # a split leaf whose other block nobody holds
        specs["params"][first] = P("x")
    return tree, specs


def _save_stage_like(path, debug, odd=""):
    """Rank r saves stage r's tree, as a pipeline's stages hold them."""
    mesh = _mesh2()
    tree, specs = _stage_tree(dist.get_rank(), odd)
    prev = functp.set_debug(debug)
    try:
        out = _outcome(lambda: functp.save(path, tree, mesh, specs))
        if out is not None or odd:
            return out
        # on the other split: rank r loads the other stage's part of the union
        theirs, their_specs = _stage_tree(1 - dist.get_rank())
        got = functp.load(path, mesh, their_specs, like=theirs)
        return [(k, torch.equal(got["params"][k], theirs["params"][k]))
                for k in sorted(theirs["params"])] + [got["step"]]
    finally:
        functp.set_debug(prev)


def test_a_pipelines_stages_save_their_union_and_load_on_another_split(run, tmp_path):
    # each rank saves its own stage's leaves (different trees): the checkpoint is their
    # union, so it loads whole on one process and in parts on any split
    path = str(tmp_path / "ckpt")
    for debug in (False, True):
        for rank, got in enumerate(run(2, _save_stage_like, path, debug)):
            assert all(ok for k, ok in got[:-1]) and got[-1] == 7, (rank, got)
            assert len(got) == 4, got           # the other stage's 3 leaves and step
        whole = functp.load(path)
        assert sorted(whole["params"]) == ["embed", "head", "layers.0.w", "layers.1.w",
                                           "layers.2.w", "layers.3.w"], whole
        assert torch.equal(whole["params"]["head"], randn(2, seed=6))
        assert torch.equal(whole["params"]["layers.2.w"], randn(2, seed=2))


@pytest.mark.parametrize("odd,words", [
    ("opt", ["'params.state.0.exp_avg'", "numbers each stage's parameters"]),
    ("half", ["'params.embed' is split over ['x'] but only 1 of its 2 blocks is saved"]),
    ("value", ["the value 'step' is 7 on one rank, 8 on another"]),
])
def test_stages_whose_union_is_no_checkpoint_raise_on_every_rank(run, tmp_path, odd, words):
    path = str(tmp_path / "ckpt")
    msgs = _all_raise(run(2, _save_stage_like, path, False, odd), "different trees",
                      "not one checkpoint", *words[:1])
    assert all(w in m for m in msgs for w in words), msgs
    assert not os.path.exists(os.path.join(path, ".metadata")), "nothing was written"


# -- check mode: replicated leaves that differ are caught at save ---------------------------


def _save_differing(path, debug, which):
    """Saves on (2,) or (2, 2): ``w`` split over the first axis (blocks differ, rightly)
    and ``b`` replicated, differing between ranks when ``which`` says so."""
    r, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh2() if world == 2 else functp.make_mesh((2, 2), ("dp", "tp"))
    a = mesh.axis_names[0]
    tree = {"w": randn(4, seed=mesh.axis_index(a)),   # a block of w, split over a
            "b": randn(3, seed=10 + (r if which == "b" else 0)),
            "step": 3 + (r if which == "step" else 0)}
    if world == 4:             # v split over dp, differing over tp where asked
        tree["v"] = randn(2, seed=20 + mesh.axis_index("dp") * 2
                          + (mesh.axis_index("tp") if which == "v" else 0))
    specs = {"w": P(a), "b": P(), "step": P(), "v": P("dp")}
    prev = functp.set_debug(debug)
    try:
        return _outcome(lambda: functp.save(path, tree, mesh,
                                            {k: specs[k] for k in tree})), tree["b"]
    finally:
        functp.set_debug(prev)


def test_check_mode_refuses_replicas_that_differ(run, tmp_path):
    path = str(tmp_path / "ckpt")
    outcomes, _ = zip(*run(2, _save_differing, path, True, "b"))
    msgs = _all_raise(outcomes, "tree['b']", "P()", "('x',)", "ranks [0]", "ranks [1]",
                      "FUNCTP_DEBUG")
    assert all("pmean" in m and "mentions 'x'" in m for m in msgs), msgs
    assert not os.path.exists(path), "nothing was written"
    outcomes, _ = zip(*run(2, _save_differing, path, True, "step"))
    _all_raise(outcomes, "tree['step']", "non-tensor", "ranks [0]", "ranks [1]")
    # blocks of a split leaf differ rightly: saved
    assert [o for o, _ in run(2, _save_differing, path, True, None)] == [None, None]


def test_check_mode_compares_only_the_ranks_that_replicate_a_leaf(run, tmp_path):
    path = str(tmp_path / "ckpt")
    # v: P('dp') differs over dp (its blocks) on every rank: saved
    assert [o for o, _ in run(4, _save_differing, path, True, None)] == [None] * 4
    # v differing over tp, which its spec does not mention: ranks 0 and 1 (dp=0) differ
    outcomes, _ = zip(*run(4, _save_differing, path, True, "v"))
    _all_raise(outcomes, "tree['v']", "P('dp')", "('tp',)", "ranks [0]", "ranks [1]")


def _load_b(path):
    return functp.load(path, _mesh2(), P(), like={"b": 0})["b"]


def test_without_check_mode_one_replica_is_kept(run, tmp_path):
    path = str(tmp_path / "ckpt")
    outcomes, bs = zip(*run(2, _save_differing, path, False, "b"))
    assert outcomes == (None, None), "saved: only the check mode compares replicas"
    loaded = run(2, _load_b, path)
    assert torch.equal(loaded[0], loaded[1])
    assert any(torch.equal(loaded[0], b) for b in bs) and not torch.equal(bs[0], bs[1])
