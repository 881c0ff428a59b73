"""comm_log counts every collective, forward and backward, and they equal the
analytical count for each canonical layout (check_vma=False: sum semantics)."""
from __future__ import annotations

import pytest

import functp
from test_layouts import _dp_body, _fsdp_body, _megatron_body, _sp_body, _two_d_body

F64 = 8
PARAM_BYTES = (16 * 8 + 16 + 8 * 16 + 8) * F64    # the MLP of test_layouts
DATA_BYTES = 2 * 8 * 8 * F64                       # x and y, (8, 8) each


def _counts(stats):
    return {k: c for k, (c, _) in stats.items()}


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_counts(run, n):
    # forward: the loss pmean; backward: its transpose, and ONE bucketed all-reduce
    # for all four parameter gradients (plus the inputs, which check_program
    # differentiates too)
    stats = run(n, _dp_body, n, False)[0]
    assert _counts(stats) == {"all_reduce:dp": 3}
    # two scalar all-reduces and one bucket: all parameters at once
    assert stats["all_reduce:dp"][1] == 2 * F64 + PARAM_BYTES


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_counts(run, n):
    # one all_gather per parameter forward, one reduce_scatter per parameter backward
    stats = run(n, _fsdp_body, n, False)[0]
    assert _counts(stats) == {"all_gather:dp": 4, "reduce_scatter:dp": 4, "all_reduce:dp": 2}
    assert stats["all_gather:dp"][1] == PARAM_BYTES // n        # each rank sends its shard
    assert stats["reduce_scatter:dp"][1] == PARAM_BYTES         # full-size gradient input


def test_megatron_counts(run):
    # forward: the row-parallel psum; backward: its transpose, and one bucket for the
    # replicated b2 and inputs x, y
    assert _counts(run(2, _megatron_body, 2, False)[0]) == {"all_reduce:tp": 3}


def test_sequence_parallel_counts(run):
    # all_gather/psum_scatter pair and the loss psum, each with its transpose, and one
    # bucket for the replicated norm weight and b2
    assert _counts(run(2, _sp_body, 2, False)[0]) == {
        "all_gather:tp": 2, "reduce_scatter:tp": 2, "all_reduce:tp": 3}


def test_two_d_counts(run):
    # tp: the psum, its transpose, the bucket of x and y (replicated over tp);
    # dp: the loss pmean, its transpose, the bucket of w1, b1, w2; dp+tp: b2
    assert _counts(run(4, _two_d_body, (2, 2), False)[0]) == {
        "all_reduce:tp": 3, "all_reduce:dp": 3, "all_reduce:dp+tp": 1}


def _bytes_body():
    import torch
    from functp import P
    mesh = functp.make_mesh((2,), ("x",))
    f = functp.shard_map(lambda x: functp.all_gather(x, "x", tiled=True), mesh,
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
