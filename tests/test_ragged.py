"""ragged_all_to_all against rows moved by hand from every rank's data (each rank draws
every rank's operand from one seed), its gradient against the hand-derived
transpose, on 2 and 4 ranks, 1-d and 2-d meshes, torch.func.grad and tape, both
vma settings; comm_log counts exactly the routed rows. Its adjoint identity and
batching rule: ``TestRaggedAllToAll`` (as every collective's in test_collectives.py)."""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P, ShardingError
import _adjoint
from _adjoint import MESH_IDS, MESHES, assert_adjoint, typed

H = 3          # hidden size: every row is H numbers


def _counts(n: int) -> torch.Tensor:
    """counts[s][d]: rows rank s sends to rank d (zeros included)."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 4, (n, n), generator=g)


def _operands(n: int, counts: torch.Tensor) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # one spare row at the end of each operand: rows that are not sent
    return [torch.randn(int(counts[s].sum()) + 1, H, generator=g, dtype=torch.float64)
            for s in range(n)]


def _expected(me: int, n: int, counts, xs, buf):
    """The output of rank ``me``: the buffer, with the rows from each source in turn
    (ragged_offsets' layout: sources in order, from the buffer's start)."""
    out, at = buf.clone(), 0
    for s in range(n):
        start = int(counts[s, :me].sum())
        k = int(counts[s, me])
        out[at:at + k] = xs[s][start:start + k]
        at += k
    return out


def _program(kind: str, how: str, check_vma: bool, plan_kind: str):
    n_all = functp.process_count()
    mesh = functp.make_mesh((n_all,), ("ep",)) if kind == "1d" else \
        functp.make_mesh((2, n_all // 2), ("dp", "ep"))
    n = mesh.shape["ep"]
    counts = _counts(n)
    xs = _operands(n, counts)

    def weights(d):        # rank d's loss weights, one per row of its output
        return torch.randn(int(counts[:, d].sum()) + 2, H,
                           generator=torch.Generator().manual_seed(11 + d), dtype=torch.float64)

    def body(token):
        # ragged buffers differ in size per rank: they live inside the body
        me = functp.axis_index("ep")
        recv_total = int(counts[:, me].sum())
        # (+ 0 * token: values that differ per rank, and vma knows it)
        vary = token.sum() * 0
        x = xs[me].clone() + vary
        buf = torch.full((recv_total + 2, H), 0.5, dtype=torch.float64) + vary   # 2 rows stay
        w = weights(me) + vary
        plan = functp.ragged_offsets(counts[me], "ep")

        def exchange(x, b):
            if plan_kind == "lists":       # the planned lists: no exchange of offsets
                return functp.ragged_all_to_all(x, b, *plan[:4], "ep",
                                                recv_offsets=plan.recv_offsets)
            # JAX's arguments as tensors: the senders' output offsets are exchanged
            return functp.ragged_all_to_all(x, b, *[torch.tensor(v) for v in plan[:4]], "ep")

        with functp.comm_log() as log:
            if how == "grad":
                out = exchange(x, buf)
                gx, gb = torch.func.grad(lambda x, b: (exchange(x, b) * w).sum(), (0, 1))(x, buf)
            else:
                xt, bt = x.clone().requires_grad_(), buf.clone().requires_grad_()
                out = exchange(xt, bt)
                gx, gb = torch.autograd.grad((out * w).sum(), [xt, bt])
                out = out.detach()
        want = _expected(me, n, counts, xs, buf)
        # by hand: a sent row gets the weight of the row it became; the buffer gets
        # the weight where nothing landed
        want_gx = torch.zeros_like(x)
        for d in range(n):
            start, k = int(counts[me, :d].sum()), int(counts[me, d])
            land = int(counts[:me, d].sum())
            want_gx[start:start + k] = weights(d)[land:land + k]
        want_gb = w.clone()
        want_gb[:recv_total] = 0
        # the routed rows cross twice: forward (sent, and the grad's own forward
        # under torch.func.grad), and back in the backward (the rows received)
        forwards = 2 if how == "grad" else 1
        routed = (forwards * int(counts[me].sum()) + int(counts[:, me].sum())) * H * 8
        err = torch.stack([(out - want).abs().max(), (gx - want_gx).abs().max(),
                           (gb - want_gb).abs().max(),
                           torch.tensor(float(log.nbytes("ragged_all_to_all") - routed),
                                        dtype=torch.float64)])
        return err.reshape(1, 4) + token.sum() * 0

    f = functp.shard_map(body, mesh, in_specs=P("ep"), out_specs=P("ep"), check_vma=check_vma)
    return f(torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("world,kind", [(2, "1d"), (4, "1d"), (4, "2d")])
@pytest.mark.parametrize("how", ["grad", "tape"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_ragged_all_to_all_values_and_gradients(world, kind, how, check_vma):
    plan_kind = "lists" if (world + check_vma) % 2 else "tensors"
    for r, err in enumerate(functp.simulate(_program, world, kind, how, check_vma, plan_kind)):
        out, gx, gb, bytes_off = err.tolist()[0]
        assert out < 1e-12 and gx < 1e-12 and gb < 1e-12, (r, err)
        assert bytes_off == 0, f"rank {r}: comm_log bytes differ from the routed rows by {bytes_off}"


def _vmapped():
    mesh = functp.make_mesh((2,), ("ep",))
    me = mesh.axis_index("ep")
    counts = torch.tensor([[1, 2], [2, 1]])        # 3 rows out and in on each rank
    xs = torch.randn(4, 3, H, generator=torch.Generator().manual_seed(me))  # batch 4
    bufs = torch.zeros(4, 3, H)

    def one(x, b):
        plan = functp.ragged_offsets(counts[me], "ep")
        return functp.ragged_all_to_all(x, b, *plan[:4], "ep", recv_offsets=plan.recv_offsets)

    f = functp.shard_map(lambda x, b: torch.vmap(one)(x, b), mesh, in_specs=(P("ep"), P("ep")),
                         out_specs=P("ep"))
    g = functp.shard_map(lambda x, b: torch.stack([one(x[i], b[i]) for i in range(4)]), mesh,
                         in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
    return f(xs, bufs), g(xs, bufs)


def test_vmap_of_ragged_all_to_all():
    for r, (batched, looped) in enumerate(functp.simulate(_vmapped, 2)):
        torch.testing.assert_close(batched, looped, msg=f"rank {r}")


def _adjoint_cases(ch, A, n, X, E):
    me = functp.axis_index(A)
    counts = _counts(n)
    plan = functp.ragged_offsets(counts[me], A)
    x = typed((int(counts[me].sum()) + 1, H), X, 1)     # one row is not sent

    def f(x, b):
        return functp.ragged_all_to_all(x, b, *plan[:4], A, recv_offsets=plan.recv_offsets)
    # linear in both: <f(x, b), y> = <x, fᵀ_x y> + <b, fᵀ_b y>; two rows nothing lands on
    ch.linear(f, (x, typed((plan.recv_total + 2, H), X, 2)), (X, X), X)
    # a buffer invariant over A (so the same size on every rank along it) is pvary'd:
    # its cotangent is summed over A
    rows = int(counts.sum(0).max()) + 2
    ch.linear(f, (x, typed((rows, H), E, 2)), (X, E), X)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
class TestRaggedAllToAll:
    @pytest.mark.parametrize("mesh", MESHES, ids=MESH_IDS)
    def test_adjoint(self, run, mesh, check_vma):
        assert_adjoint(run(math.prod(mesh[0]), _adjoint.body, mesh, check_vma, _adjoint_cases))


def _bad(case):
    mesh = functp.make_mesh((2,), ("ep",))
    me = mesh.axis_index("ep")
    x, buf = torch.ones(4, H), torch.zeros(4, H)

    def body(x, b):
        if case == "counts":        # rank 1 expects 2 rows from rank 0, which sends 1
            recv = [0, 0] if me == 0 else [2, 0]
            return functp.ragged_all_to_all(x, b, [0, 0], [0, 1] if me == 0 else [0, 0],
                                            [0, 0], recv, "ep")
        if case == "small_buffer":
            return functp.ragged_all_to_all(x, b[:1], [0, 0], [2, 2], [0, 2], [2, 2], "ep")
        return functp.ragged_all_to_all(x, b, [0, 3], [2, 2], [0, 2], [2, 2], "ep")

    f = functp.shard_map(body, mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
    try:
        f(x, buf)
    except ShardingError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,words", [
    ("counts", ["disagree on the rows between them", "recv_sizes[0]"]),
    ("small_buffer", ["past the output buffer", "recv_total"]),
    ("operand_range", ["run past the operand"]),
])
def test_bad_sizes_are_clear_errors_on_every_rank(case, words):
    msgs = functp.simulate(_bad, 2, case, check=True)
    for r, msg in enumerate(msgs):
        assert msg != "no error", f"rank {r}"
    assert any(all(w in m for w in words) for m in msgs), msgs


def test_count_mismatch_is_seen_by_both_ranks_without_the_check_mode():
    for r, msg in enumerate(functp.simulate(_bad, 2, "counts", check=False)):
        assert "disagree on the rows between them" in msg and "peer 1 sends 0" in msg \
            or "peer 0 sends 1" in msg, (r, msg)
