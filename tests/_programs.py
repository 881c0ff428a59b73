"""Whole SPMD programs that several test modules run, each with its float64 oracle
(``_oracle.check_program``): the canonical parallel layouts of a small MLP and of
attention (``test_parallel_layouts.py`` runs them on 2, 4 and 8 ranks,
``test_comm_log.py`` counts their collectives, ``test_simulate.py`` replays them), one
collective against its unsharded equivalent (``test_collectives.py``), and the
examples run as a user runs them (``test_examples.py``, ``test_models.py``)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import subprocess
import sys

import torch

import functp
from functp import P
from _oracle import check_program, comm_stats, randn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- canonical parallel layouts: (n or mesh shape, check_vma, argnums) -> comm stats ------------

H, F, B = 8, 16, 8     # hidden, ffn width, batch: divisible by every mesh size used


def _mlp_params():
    return {"w1": randn(F, H, seed=10), "b1": randn(F, seed=11),
            "w2": randn(H, F, seed=12), "b2": randn(H, seed=13)}


def _mlp(p, x):
    return torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _dp_body(n, check_vma, argnums=None):
    mesh = functp.make_mesh((n,), ("dp",))
    x, y = randn(B, H, seed=1), randn(B, H, seed=2)
    return comm_stats(check_program(
        mesh, lambda p, x, y: _mse(_mlp(p, x), y),
        lambda p, x, y: functp.pmean(_mse(_mlp(p, x), y), "dp"),
        (_mlp_params(), x, y), (P(), P("dp"), P("dp")), check_vma=check_vma, argnums=argnums))


def _fsdp_body(n, check_vma, argnums=None):
    mesh = functp.make_mesh((n,), ("dp",))
    x, y = randn(B, H, seed=1), randn(B, H, seed=2)

    def local(p, x, y):
        full = {k: functp.all_gather(v, "dp", tiled=True) for k, v in p.items()}
        return functp.pmean(_mse(_mlp(full, x), y), "dp")
    return comm_stats(check_program(mesh, lambda p, x, y: _mse(_mlp(p, x), y), local,
                         (_mlp_params(), x, y), (P("dp"), P("dp"), P("dp")),
                         check_vma=check_vma, argnums=argnums))


TP_SPECS = {"w1": P("tp", None), "b1": P("tp"), "w2": P(None, "tp"), "b2": P()}


def _megatron_local(p, x, y, dp=None):
    h = torch.tanh(x @ p["w1"].T + p["b1"])          # column parallel: no communication
    out = functp.psum(h @ p["w2"].T, "tp") + p["b2"]  # row parallel: one all-reduce
    loss = _mse(out, y)
    return functp.pmean(loss, dp) if dp else loss


def _megatron_body(n, check_vma, argnums=None):
    mesh = functp.make_mesh((n,), ("tp",))
    x, y = randn(B, H, seed=1), randn(B, H, seed=2)
    return comm_stats(check_program(mesh, lambda p, x, y: _mse(_mlp(p, x), y), _megatron_local,
                         (_mlp_params(), x, y), (TP_SPECS, P(), P()),
                         check_vma=check_vma, argnums=argnums))


def _two_d_body(shape, check_vma, argnums=None):
    mesh = functp.make_mesh(shape, ("dp", "tp"))
    x, y = randn(B, H, seed=1), randn(B, H, seed=2)
    return comm_stats(check_program(mesh, lambda p, x, y: _mse(_mlp(p, x), y),
                         lambda p, x, y: _megatron_local(p, x, y, dp="dp"),
                         (_mlp_params(), x, y), (TP_SPECS, P("dp"), P("dp")),
                         check_vma=check_vma, argnums=argnums))


S = 8   # sequence length


def _sp_params():
    return {"norm": 1 + 0.1 * randn(H, seed=20), **_mlp_params()}


def _norm(x, w):
    return x * torch.rsqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * w


def _sp_global(p, x):
    h = _norm(x, p["norm"])
    return ((x + _mlp(p, h)) ** 2).mean()


def _sp_local(p, x):
    # x: (batch, seq/tp, hidden). The norm runs on the sequence shard; all_gather
    # the sequence before the column-parallel matmul, reduce-scatter it after the
    # row-parallel one (Megatron sequence parallelism).
    h = functp.all_gather(_norm(x, p["norm"]), "tp", axis=1, tiled=True)
    h = torch.tanh(h @ p["w1"].T + p["b1"]) @ p["w2"].T
    h = functp.psum_scatter(h, "tp", scatter_dimension=1, tiled=True) + p["b2"]
    return functp.psum(((x + h) ** 2).sum(), "tp") / x.shape[0] / S / H


def _sp_body(n, check_vma, argnums=None):
    mesh = functp.make_mesh((n,), ("tp",))
    specs = {"norm": P(), **TP_SPECS}
    return comm_stats(check_program(mesh, _sp_global, _sp_local, (_sp_params(), randn(2, S, H, seed=3)),
                         (specs, P(None, "tp")), check_vma=check_vma, argnums=argnums))


def _ring_body(n, check_vma, argnums=None):
    """Each rank accumulates every block by passing its block around the ring."""
    mesh = functp.make_mesh((n,), ("x",))
    ring = [(i, (i + 1) % n) for i in range(n)]

    def local(x, w):
        acc, cur = x * w, x
        for _ in range(n - 1):
            cur = functp.ppermute(cur, "x", ring)
            acc = acc + torch.sin(cur) * w
        return functp.psum((acc ** 2).sum(), "x")

    def glob(x, w):
        blocks = list(x.view(n, -1, 3))
        accs = [blocks[i] * w + sum(torch.sin(blocks[j]) * w for j in range(n) if j != i)
                for i in range(n)]
        return sum((a ** 2).sum() for a in accs)
    return comm_stats(check_program(mesh, glob, local, (randn(2 * n, 3, seed=1), randn(2, 3, seed=2)),
                         (P("x"), P()), check_vma=check_vma, argnums=argnums))


def _attention(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def _ulysses_body(n, check_vma, argnums=None):
    """Sequence-sharded activations become head-sharded for attention and back."""
    mesh = functp.make_mesh((n,), ("sp",))
    heads, d = n * 2, 4
    q, k, v = (randn(2, S, heads, d, seed=s) for s in (1, 2, 3))

    def local(q, k, v):
        to_heads = lambda t: functp.all_to_all(t, "sp", 2, 1, tiled=True)
        o = _attention(to_heads(q), to_heads(k), to_heads(v))
        o = functp.all_to_all(o, "sp", 1, 2, tiled=True)      # back to sequence shards
        return functp.psum((o.sin() ** 2).sum(), "sp")
    return comm_stats(check_program(mesh, lambda q, k, v: (_attention(q, k, v).sin() ** 2).sum(), local,
                         (q, k, v), P(None, "sp"), check_vma=check_vma, argnums=argnums))


def _multi_axis_body(shape, check_vma, argnums=None):
    mesh = functp.make_mesh(shape, ("dp", "tp"))
    n = math.prod(shape)
    return comm_stats(check_program(
        mesh, lambda x, w: ((x.view(n, 2, 3).sum(0) * w).tanh()).sum(),
        lambda x, w: ((functp.psum(x, ("dp", "tp")) * w).tanh()).sum(),
        (randn(2 * n, 3, seed=1), randn(2, 3, seed=2)), (P(("dp", "tp")), P()),
        check_vma=check_vma, argnums=argnums))


# -- one collective against its unsharded equivalent ---------------------------------------------

def _readout(out, w):
    """A nonlinear scalar of a collective's output, so its cotangent is not constant."""
    return (out * w).sum() + 0.5 * (out.sin() ** 2).sum()


def _case(name, mesh, axes, **kw):
    """(global_fn, local_fn, args, in_specs) for one collective over ``axes``."""
    n = mesh.axis_size(axes)
    A = axes if len(axes) > 1 else axes[0]
    x = randn(n * 2, 3, seed=1)
    if name in ("psum", "pmean", "pmax", "pmin"):
        red = {"psum": lambda b: b.sum(0), "pmean": lambda b: b.mean(0),
               "pmax": lambda b: b.amax(0), "pmin": lambda b: b.amin(0)}[name]
        coll = getattr(functp, name)
        if kw.get("ties"):
            x = randn(2, 3, seed=1).repeat(n, 1)
            x[0, 0] += 1.0            # one element with a unique extremum
        w = randn(2, 3, seed=2)
        return (lambda x, w: _readout(red(x.view(n, 2, 3)), w),
                lambda x, w: _readout(coll(x, A), w), (x, w), (P(A), P()))
    if name in ("all_gather", "all_gather_invariant"):
        axis, tiled = kw["axis"], kw["tiled"]
        join = torch.cat if tiled else torch.stack
        w = join(list(randn(n * 2, 3, seed=2).view(n, 2, 3)), axis)
        if name == "all_gather":    # the result varies over A: every rank's copy is
            # averaged back to one replicated value (pmean of identical copies)
            loc = lambda x, w: functp.pmean(_readout(functp.all_gather(x, A, axis=axis, tiled=tiled), w), A)
        else:
            loc = lambda x, w: _readout(functp.all_gather_invariant(x, A, axis=axis, tiled=tiled), w)
        return (lambda x, w: _readout(join(list(x.view(n, 2, 3)), axis), w), loc,
                (x, w), (P(A), P()))
    if name == "psum_scatter":
        d, tiled = kw["dim"], kw["tiled"]
        shape = [2, 3]
        shape[d] = 2 * n if tiled else n
        xs = randn(n, *shape, seed=1)       # rank i contributes xs[i]
        total = xs.sum(0)
        if tiled:
            out_spec = P(*[None] * d, A)
            w = randn(*total.shape, seed=2)
            glob = lambda xs, w: _readout(xs.sum(0), w)
            loc = lambda xs, w: functp.psum(_readout(
                functp.psum_scatter(xs[0], A, scatter_dimension=d, tiled=True), w), A)
        else:
            out_spec = P(A)
            w = randn(*total.movedim(d, 0).shape, seed=2)
            glob = lambda xs, w: _readout(xs.sum(0).movedim(d, 0), w)
            loc = lambda xs, w: functp.psum(_readout(
                functp.psum_scatter(xs[0], A, scatter_dimension=d).unsqueeze(0), w), A)
        return glob, loc, (xs, w), (P(A), out_spec)
    if name == "all_to_all":
        split, concat, tiled = kw["split"], kw["concat"], kw["tiled"]
        if tiled:   # moves the split of a (2n, 3n) matrix from dim `concat` to `split`
            x = randn(2 * n, 3 * n, seed=1)
            in_spec = P(*[None] * concat, A)
            out_spec = P(*[None] * split, A)
            w = randn(2 * n, 3 * n, seed=2)
            glob = lambda x, w: _readout(x, w)
        else:       # split=0, concat=1: rank j gets row j of every rank's block
            x = randn(n * n, 5, seed=1)
            in_spec, out_spec = P(A), P(A)
            w = randn(n * 5, n, seed=2)
            glob = lambda x, w: _readout(torch.cat([x.view(n, n, 5)[:, j].T for j in range(n)]), w)
        loc = lambda x, w: functp.psum(_readout(
            functp.all_to_all(x, A, split, concat, tiled=tiled), w), A)
        return glob, loc, (x, w), (in_spec, out_spec)
    if name == "ppermute":
        perm = kw["perm"](n)
        w = randn(n * 2, 3, seed=2)

        def glob(x, w):
            blocks = list(x.view(n, 2, 3))
            out = [torch.zeros_like(blocks[0]) for _ in range(n)]
            for s, d in perm:
                out[d] = blocks[s]
            return _readout(torch.cat(out), w)
        loc = lambda x, w: functp.psum(_readout(functp.ppermute(x, A, perm), w), A)
        return glob, loc, (x, w), (P(A), P(A))
    raise KeyError(name)


def _collective_body(shape, names, axes, name, kw, check_vma):
    mesh = functp.make_mesh(shape, names)
    glob, loc, args, specs = _case(name, mesh, axes, **kw)
    check_program(mesh, glob, loc, args, specs, check_vma=check_vma)


def _ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


def _one_pair(n):
    return [(0, n - 1)]


# -- the examples --------------------------------------------------------------------------------

@contextlib.contextmanager
def _example(script: str, suffix: str = ""):
    """``examples/<script>`` imported as a module of its own (its folder on
    ``sys.path`` meanwhile, for its ``_example`` helpers), the thread count its
    ``main()`` sets restored after."""
    folder = os.path.join(ROOT, "examples")
    sys.path.insert(0, folder)
    threads = torch.get_num_threads()
    try:
        spec = importlib.util.spec_from_file_location(f"example_{script[:-3]}{suffix}",
                                                      os.path.join(folder, script))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(folder)
        torch.set_num_threads(threads)


def example_main(script: str, argv: list[str] | None = None, attrs: dict | None = None):
    """``examples/<script>``'s ``main(argv)`` (``main()`` without ``argv``) on this rank
    of a gloo pool (``run(n, example_main, ..., gloo=True)``), as under torchrun: the
    check mode off, ``attrs`` set on the module first (a flag it reads from
    ``sys.argv`` at import), the default dtype and thread count restored after.
    **Returns:** ``(main's result, what it printed)``. For runs that check values
    after a run of the same example launched as a user launches it: a pool's
    processes exist already (a launch costs ~2.5 CPU-s a process)."""
    dtype, out = torch.get_default_dtype(), io.StringIO()
    prev = functp.set_debug(False)
    try:
        with _example(script, "_pooled") as module:
            for k, v in (attrs or {}).items():
                setattr(module, k, v)
            with contextlib.redirect_stdout(out):
                ok = module.main(*([] if argv is None else [argv]))
    finally:
        functp.set_debug(prev)
        torch.set_default_dtype(dtype)
    return ok, out.getvalue()


def _run_example(script: str, nproc: int | None = None, simulate: bool = False,
                 args: list[str] = ()) -> str:
    """Runs ``examples/<script>`` as a user would: directly (it launches its own
    processes), with ``nproc`` under torchrun with that many processes, or with
    ``simulate`` as its ranks (``nproc`` or its own count) simulated in this process;
    ``args`` go to the script (processes only). Returns its stdout after
    checking that it succeeded and reported no mismatch."""
    path = os.path.join(ROOT, "examples", script)
    if simulate:
        # an example's shutdown takes an initialized process group for torchrun's and
        # ends the process (os._exit): the whole pytest run would stop with status 0
        assert not torch.distributed.is_initialized(), (
            "a test before this one left a process group initialized in the pytest "
            "process: run its program under functp.simulate, or destroy the group")
        out = io.StringIO()
        with _example(script) as module, contextlib.redirect_stdout(out):
            results = functp.simulate(module.main, nproc or module.NPROC)
        assert all(results), out.getvalue()
        assert "MISMATCH" not in out.getvalue(), out.getvalue()
        return out.getvalue()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = ([sys.executable, path] if nproc is None else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), path]) + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MISMATCH" not in out.stdout, out.stdout
    return out.stdout
