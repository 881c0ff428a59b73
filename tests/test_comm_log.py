"""comm_log counts every collective, forward and backward; for each canonical layout
the counts and bytes of one training step (gradients w.r.t. the parameters) equal
the analytical minimum with vma tracking, and the documented extra all-reduces of
the sum-semantics rules with check_vma=False."""
from __future__ import annotations

import pytest

import functp
from _programs import _dp_body, _fsdp_body, _megatron_body, _sp_body, _two_d_body

F64 = 8
W1, B1, W2, B2 = 16 * 8 * F64, 16 * F64, 8 * 16 * F64, 8 * F64    # the layouts' MLP (_programs)
PARAM_BYTES = W1 + B1 + W2 + B2
PARAMS = (0,)      # differentiate the parameters only, as a training step does


def _counts(stats):
    return {k: c for k, (c, _) in stats.items()}


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel(run, n):
    # vma: forward the loss pmean; backward the four parameter gradients (their uses
    # vary over dp) in one bucket, nothing for the pmean (its transpose is free)
    vma = run(n, _dp_body, n, True, PARAMS)[0]
    assert _counts(vma) == {"all_reduce:dp": 2}
    assert vma["all_reduce:dp"][1] == F64 + PARAM_BYTES
    # sum semantics: the pmean's transpose all-reduces too; the four parameters are
    # replicated inputs, summed in one bucket
    plain = run(n, _dp_body, n, False, PARAMS)[0]
    assert _counts(plain) == {"all_reduce:dp": 3}
    assert plain["all_reduce:dp"][1] == 2 * F64 + PARAM_BYTES


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_fsdp(run, check_vma):
    # one all_gather per parameter forward, one reduce_scatter per parameter backward
    stats = run(2, _fsdp_body, 2, check_vma, PARAMS)[0]
    assert _counts(stats) == {"all_gather:dp": 4, "reduce_scatter:dp": 4,
                              "all_reduce:dp": 1 if check_vma else 2}
    assert stats["all_gather:dp"][1] == PARAM_BYTES // 2     # each rank sends its shard
    assert stats["reduce_scatter:dp"][1] == PARAM_BYTES      # full-size gradient input


def test_megatron(run):
    # vma: the row-parallel psum forward, and no tp collective at all backward
    assert _counts(run(2, _megatron_body, 2, True, PARAMS)[0]) == {"all_reduce:tp": 1}
    # sum: the psum's transpose and the bucket of the replicated b2
    assert _counts(run(2, _megatron_body, 2, False, PARAMS)[0]) == {"all_reduce:tp": 3}


def test_megatron_input_gradient_is_the_f_operator(run):
    # differentiating x too: x meets the tp-varying w1, so its gradient is summed over
    # tp: exactly Megatron's f (identity forward, all-reduce backward)
    stats = run(2, _megatron_body, 2, True, (0, 1))[0]
    assert _counts(stats) == {"all_reduce:tp": 2}


def test_sequence_parallel(run):
    # all_gather / psum_scatter pair, each transposed to the other, the loss psum
    # forward, and the replicated norm weight and b2 (used on sequence shards)
    # all-reduced backward in one bucket
    stats = run(2, _sp_body, 2, True, PARAMS)[0]
    assert _counts(stats) == {"all_gather:tp": 2, "reduce_scatter:tp": 2, "all_reduce:tp": 2}
    assert stats["all_reduce:tp"][1] == F64 + (8 * F64) + B2


def test_two_d(run):
    # tp: the forward psum only; dp: the loss pmean forward and one bucket of the
    # four parameter gradients backward (b2 over dp only: it is invariant over tp
    # where it is used)
    stats = run(4, _two_d_body, (2, 2), True, PARAMS)[0]
    assert _counts(stats) == {"all_reduce:tp": 1, "all_reduce:dp": 2}
    assert stats["all_reduce:dp"][1] == F64 + W1 // 2 + B1 // 2 + W2 // 2 + B2
    # sum semantics on the same step
    assert _counts(run(4, _two_d_body, (2, 2), False, PARAMS)[0]) == {
        "all_reduce:tp": 2, "all_reduce:dp": 3, "all_reduce:dp+tp": 1}


def _bytes_body():
    import torch
    from functp import P
    mesh = functp.make_mesh((2,), ("x",))
    f = functp.shard_map(lambda x: functp.all_gather_invariant(x, "x", tiled=True), mesh,
                         in_specs=P("x"), out_specs=P())
    with functp.comm_log() as log:
        f(torch.zeros(3, 5, dtype=torch.float32))
    assert log.events == [functp.CommEvent("all_gather", ("x",), 3 * 5 * 4)]
    assert log.count("all_gather", "x") == 1 and log.nbytes() == 60
    with functp.comm_log() as outer:
        with functp.comm_log() as inner:
            f(torch.zeros(1))
        f(torch.zeros(1))
    assert (len(inner), len(outer)) == (1, 2)


def test_events_record_op_axes_and_bytes(run):
    run(2, _bytes_body)


def _invariant_costs_nothing_body():
    import torch
    from functp import P
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    w = torch.randn(3, 3, dtype=torch.float64)
    f = functp.shard_map(lambda w: (w.tanh() @ w).sum(), mesh, in_specs=P(), out_specs=P())
    with functp.comm_log() as log:
        g = torch.func.grad(f)(w)
    torch.testing.assert_close(g, torch.func.grad(lambda w: (w.tanh() @ w).sum())(w))
    return len(log)


def test_invariant_computation_costs_nothing(run):
    assert run(4, _invariant_costs_nothing_body) == [0] * 4
