"""Canonical parallel layouts as whole programs, against the unsharded float64 model:
data parallel, FSDP, Megatron tensor parallel, sequence parallel, 2-D (dp x tp),
a ppermute ring, all_to_all sequence<->head parallel attention, multi-axis psum."""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P
from _oracle import check_program, comm_stats, randn

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


VMA = pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])


@VMA
@pytest.mark.parametrize("n", [2, 4, 8])
def test_data_parallel(run, n, check_vma):
    run(n, _dp_body, n, check_vma)


@VMA
@pytest.mark.parametrize("n", [2, 4, 8])
def test_fsdp(run, n, check_vma):
    run(n, _fsdp_body, n, check_vma)


@VMA
@pytest.mark.parametrize("n", [2, 4, 8])
def test_megatron_mlp(run, n, check_vma):
    run(n, _megatron_body, n, check_vma)


@VMA
@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2)])
def test_two_d_dp_tp(run, shape, check_vma):
    run(math.prod(shape), _two_d_body, shape, check_vma)


@VMA
@pytest.mark.parametrize("n", [2, 4, 8])
def test_sequence_parallel(run, n, check_vma):
    run(n, _sp_body, n, check_vma)


@VMA
@pytest.mark.parametrize("n", [2, 4])
def test_ppermute_ring(run, n, check_vma):
    run(n, _ring_body, n, check_vma)


@VMA
@pytest.mark.parametrize("n", [2, 4])
def test_all_to_all_sequence_head_parallel_attention(run, n, check_vma):
    run(n, _ulysses_body, n, check_vma)


@VMA
@pytest.mark.parametrize("shape", [(2, 2), (2, 4)])
def test_multi_axis_psum(run, shape, check_vma):
    run(math.prod(shape), _multi_axis_body, shape, check_vma)
