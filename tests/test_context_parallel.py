"""functp.attention (issue 53): every strategy's output and gradients equal the whole
sequence's float64 attention (1e-10), on 1-d and 2-d (cp x tp) meshes, load-balanced
and contiguous, causal or not, GQA, sliding windows, packed documents and logit
soft-capping, through
torch.func.grad and tape autograd; the errors, identical on every rank.

Each body runs many cases (simulated ranks are cheap; gloo checks a few on processes).
"""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P

TOL = 1e-10
STRATEGIES = ("allgather", "ulysses", "ring")


# ---------------------------------------------------------------------------------
# the oracle: softmax attention over the whole sequence, written out


def reference(q, k, v, *, causal=False, window=None, position_ids=None, softcap=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:            # (Gemma-2's attn_logit_softcapping, before the mask)
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(q.shape[2])
    keep = torch.ones(len(i), len(i), dtype=torch.bool)
    if causal:
        keep &= i[:, None] >= i[None, :]
    if window is not None:
        keep &= (i[:, None] - i[None, :]).abs() < window
    if position_ids is not None:
        doc = torch.cumsum(position_ids == 0, 1)
        keep = keep & (doc[:, None, :, None] == doc[:, None, None, :])
    return s.masked_fill(~keep, -torch.inf).softmax(-1) @ v


def packed_positions(batch, n):
    """Row 0: three documents of uneven lengths; the others: one document."""
    a, b = n // 3, n // 2
    rows = [torch.cat([torch.arange(a), torch.arange(b), torch.arange(n - a - b)])]
    return torch.stack(rows + [torch.arange(n)] * (batch - 1))


# ---------------------------------------------------------------------------------
# one case: a cp-split attention against the oracle


def _case(mesh, spec, strategy, *, balanced, causal, hq, hk, seq, window=None, docs=False,
          head_dim=3, batch=2, seed=0, softcap=None):
    """Max |difference| of the output and of q, k, v's gradients (torch.func.grad and
    tape) from the oracle's, as a dict."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(batch, h, seq, head_dim, generator=g, dtype=torch.float64)
                  for h in (hq, hk, hk, hq))
    pos = packed_positions(batch, seq) if docs else None
    opts = dict(causal=causal, window=window, softcap=softcap)
    lay = dict(dim=2, balanced=balanced, spec=spec)
    loc = functp.cp_shard((q, k, v, w), mesh, **lay)
    pos_loc = None if pos is None else functp.cp_shard(pos, mesh, balanced=balanced)
    axes = tuple(mesh.axis_names)

    def body(q, k, v, w, p):
        out = functp.attention(q, k, v, "cp", strategy=strategy, balanced=balanced,
                               position_ids=p, **opts)
        return out, functp.psum((out * w).sum(), axes)

    pspec = P(None, "cp")
    f = functp.shard_map(body, mesh, in_specs=(spec,) * 4 + (pspec,), out_specs=(spec, P()))
    out = functp.cp_unshard(f(*loc, pos_loc)[0], mesh, **lay)
    want = reference(q, k, v, position_ids=pos, **opts)
    ref_g = torch.func.grad(lambda t: (reference(*t, position_ids=pos, **opts) * w).sum())(
        (q, k, v))
    fg = torch.func.grad(lambda t: f(*t, loc[3], pos_loc)[1])(loc[:3])
    leaves = [t.detach().requires_grad_() for t in loc[:3]]
    f(*leaves, loc[3], pos_loc)[1].backward()
    err = {"out": (out - want).abs().max().item()}
    for how, grads in (("func.grad", fg), ("tape", [t.grad for t in leaves])):
        full = functp.cp_unshard(tuple(grads), mesh, **lay)
        err[how] = max((a - b).abs().max().item() for a, b in zip(full, ref_g))
    return err


def _check_all(mesh, spec, cases):
    bad = {}
    for name, kw in cases:
        err = _case(mesh, spec, **kw)
        if max(err.values()) > TOL:
            bad[name] = err
    assert not bad, f"cases off the oracle: {bad}"
    return len(cases)


def _grid(seq, heads, **extra):
    return [(f"{s} balanced={b} causal={c} heads={hq}/{hk} {extra}",
             dict(strategy=s, balanced=b, causal=c, hq=hq, hk=hk, seq=seq, **extra))
            for s in STRATEGIES for b in (True, False) for c in (True, False)
            for hq, hk in heads]


def _one_d_body(n):
    mesh = functp.make_mesh((n,), ("cp",))
    spec = P(None, None, "cp", None)
    cases = _grid(4 * n, [(4, 4), (4, 2), (4, 1)])
    # a sliding window and packed documents under every strategy (window < block, so
    # the ring's far blocks are hidden entirely)
    cases += [(f"{s} window docs={d}", dict(strategy=s, balanced=True, causal=True, hq=4,
                                              hk=2, seq=4 * n, window=3, docs=d))
              for s in STRATEGIES for d in (False, True)]
    cases += [(f"{s} docs non-causal", dict(strategy=s, balanced=False, causal=False, hq=4,
                                             hk=2, seq=4 * n, docs=True)) for s in STRATEGIES]
    # logit soft-capping (0.5: most scores of these normal q, k are capped hard), with
    # GQA, a window and documents too
    cases += [(f"{s} softcap causal={c} balanced={b}",
               dict(strategy=s, balanced=b, causal=c, hq=4, hk=2, seq=4 * n, softcap=0.5))
              for s in STRATEGIES for c in (True, False) for b in (True, False)]
    cases += [(f"{s} softcap window docs", dict(strategy=s, balanced=True, causal=True, hq=4,
                                                 hk=2, seq=4 * n, window=3, docs=True,
                                                 softcap=0.5)) for s in STRATEGIES]
    return _check_all(mesh, spec, cases)


@pytest.mark.parametrize("n", [2, 4])
def test_every_strategy_exact_on_a_cp_axis(run, n):
    assert run(n, _one_d_body, n) == [60] * n


def _two_d_body():
    # heads over tp, the sequence over cp: ulysses splits each rank's tp heads over cp
    mesh = functp.make_mesh((2, 2), ("cp", "tp"))
    spec = P(None, "tp", "cp", None)
    cases = _grid(8, [(4, 4), (4, 2)])
    cases += [(f"{s} softcap", dict(strategy=s, balanced=True, causal=True, hq=4, hk=2,
                                    seq=8, softcap=0.5)) for s in STRATEGIES]
    return _check_all(mesh, spec, cases)


def test_cp2_x_tp2_heads_split_over_tp(run):
    assert run(4, _two_d_body) == [27] * 4


def _eight_body():
    mesh = functp.make_mesh((8,), ("cp",))
    spec = P(None, None, "cp", None)
    cases = [(s, dict(strategy=s, balanced=True, causal=True, hq=8, hk=2, seq=16))
             for s in STRATEGIES]
    cases.append(("allgather docs", dict(strategy="allgather", balanced=True, causal=True,
                                         hq=2, hk=1, seq=16, docs=True, batch=1)))
    return _check_all(mesh, spec, cases)


def test_eight_ranks_simulated(run):
    assert run(8, _eight_body) == [4] * 8


def _gloo_body():
    n = functp.process_count()
    mesh = functp.make_mesh((n,), ("cp",))
    cases = [(s, dict(strategy=s, balanced=True, causal=True, hq=4, hk=2, seq=4 * n))
             for s in STRATEGIES]
    return _check_all(mesh, P(None, None, "cp", None), cases)


@pytest.mark.parametrize("n", [2, 4])
def test_gloo_processes(run, n):
    assert run(n, _gloo_body, gloo=True) == [3] * n


# ---------------------------------------------------------------------------------
# the layout helpers


def _layout_body():
    mesh = functp.make_mesh((4,), ("cp",))
    x = torch.arange(16)[None]
    block = functp.cp_shard(x, mesh)
    inside = functp.shard_map(lambda b: functp.cp_positions(16) + 0 * b, mesh,
                              in_specs=P(None, "cp"), out_specs=P(None, "cp"))(block)
    return (block[0].tolist(), functp.cp_positions(16, mesh).tolist(), inside[0].tolist(),
            torch.equal(functp.cp_unshard(block, mesh), x),
            functp.cp_shard(x, mesh, balanced=False)[0].tolist())


def test_load_balanced_layout_and_positions(run):
    chunks = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    for r, (block, pos, inside, back, plain) in enumerate(run(4, _layout_body)):
        # the block holds the tokens at these positions: the same numbers, three ways
        assert block == pos == inside == chunks[r], (r, block, pos, inside)
        assert back and plain == list(range(4 * r, 4 * r + 4))


# ---------------------------------------------------------------------------------
# errors: the same message on every rank, naming the fix


def _message(fn):
    try:
        fn()
    except functp.ShardingError as e:
        return str(e)
    return None


def _errors_body():
    mesh = functp.make_mesh((2,), ("cp",))
    spec = P(None, None, "cp", None)
    q = functp.cp_shard(torch.randn(1, 3, 8, 2), mesh, dim=2)

    def attend(strategy, **kw):
        return lambda: functp.shard_map(
            lambda q: functp.attention(q, q, q, strategy=strategy, **kw), mesh,
            in_specs=spec, out_specs=spec)(q)
    odd = functp.shard(torch.randn(1, 3, 6, 2), mesh, spec)    # blocks of 3 tokens
    return [
        _message(attend("ulysses")),
        _message(lambda: functp.cp_shard(torch.zeros(1, 10), mesh)),
        _message(lambda: functp.shard_map(
            lambda q: functp.attention(q, q, q, causal=True), mesh,
            in_specs=spec, out_specs=spec)(odd)),
        _message(attend("flash")),
        _message(lambda: functp.shard_map(
            lambda q: functp.attention(q, q[:, :2], q[:, :2]), mesh,
            in_specs=spec, out_specs=spec)(q)),
        _message(attend("ring", softcap=-1.0)),
    ]


def test_errors_on_every_rank_name_the_fix(run):
    per_rank = run(2, _errors_body)
    assert per_rank[0] == per_rank[1], per_rank
    ulysses, length, odd, name, gqa, softcap = per_rank[0]
    assert "3 q heads" in ulysses and "multiple of 2" in ulysses and "allgather" in ulysses
    assert "10 tokens" in length and "multiple of 2 * cp = 4" in length and "to 12" in length
    assert "3 tokens" in odd and "balanced=False" in odd and "cp_shard" in odd
    assert "'flash'" in name and "ring" in name
    assert "3 heads and k/v 2" in gqa
    assert "softcap=-1.0" in softcap and "positive number" in softcap, softcap
