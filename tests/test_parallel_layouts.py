"""Canonical parallel layouts as whole programs, against the unsharded float64 model:
data parallel, FSDP, Megatron tensor parallel, sequence parallel, 2-D (dp x tp),
a ppermute ring, all_to_all sequence<->head parallel attention, multi-axis psum (the
programs and their unsharded equivalents: ``_programs.py``)."""
from __future__ import annotations

import math

import pytest


from _programs import (_dp_body, _fsdp_body, _megatron_body, _multi_axis_body, _ring_body,
                       _sp_body, _two_d_body, _ulysses_body)

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
