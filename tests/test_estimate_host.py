"""Host time in functp.estimate: the counts it records and the per-stretch sum, with
the per-call costs injected (no timing is asserted)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import functp
from functp.tools._host_count import PyCalls

# a profile whose device is fast and whose host costs are round numbers
HW = dataclasses.replace(functp.tools._hardware.HARDWARE["h100-sxm"],
                         host_call=1e-6, host_python=1e-7)


def _synced():
    """Two matmul stretches with a host read (.item()) between them."""
    a = torch.randn(64, 64)
    b = a @ a
    if b.sum().item() > -1e30:       # the read: the host waits for the device here
        b = b @ a
    return b @ a


def test_step_is_cut_at_host_reads_and_each_stretch_is_max_of_device_and_host():
    t = functp.estimate(_synced, 1, hardware=HW).seconds
    assert len(t.stretches) == 2
    assert t.host_calls > 0 and t.python_calls > 0
    # each stretch's host time is its own counts at the injected costs, summed
    assert t.host == pytest.approx(t.host_calls * 1e-6 + t.python_calls * 1e-7)
    assert t.host == pytest.approx(sum(h for _, _, h in t.stretches))
    assert t.compute == pytest.approx(sum(c for c, _, _ in t.stretches))
    assert t.overlapped == pytest.approx(sum(max(c, m, h) for c, m, h in t.stretches))
    assert t.serial == pytest.approx(sum(max(c + m, h) for c, m, h in t.stretches))
    # the cut is not the whole step's max: a device-bound stretch beside a
    # host-bound one adds up
    one = max(t.compute, t.communication, t.host)
    assert t.overlapped >= one
    assert "2 stretches between host reads" in str(functp.estimate(_synced, 1, hardware=HW))


def test_no_read_one_stretch():
    def program():
        a = torch.randn(64, 64)
        return a @ a
    t = functp.estimate(program, 1, hardware=HW).seconds
    assert len(t.stretches) == 1
    assert t.overlapped == pytest.approx(max(t.compute, t.communication, t.host))


def test_functp_python_is_counted():
    """A functp shard_map step counts functp's own Python calls on top of the same
    operators a plain step issues."""
    def plain():
        w = torch.randn(16, 16, requires_grad=True)
        (torch.ones(4, 16) @ w).tanh().sum().backward()
        return w.grad

    def sharded():
        mesh = functp.make_mesh((1,), ("dp",))
        w = torch.randn(16, 16, requires_grad=True)
        f = functp.shard_map(lambda w, x: functp.psum((x @ w).tanh().sum(), "dp"), mesh,
                             in_specs=(functp.P(), functp.P("dp")), out_specs=functp.P())
        f(w, torch.ones(4, 16)).backward()
        return w.grad
    p = functp.estimate(plain, 1, hardware=HW).seconds
    s = functp.estimate(sharded, 1, hardware=HW).seconds
    assert s.python_calls > p.python_calls + 20


def test_pycalls_counts_python_and_c_calls():
    def f(x):
        return len([x, x])
    with PyCalls() as c:
        f(1)
    assert c.total == 1 and c.builtin >= 1 and c.functp == 0


def test_counting_leaves_the_peak_alone():
    """Counting the host's calls holds no frame (and so no tensor) past its return."""
    def program():
        a = torch.randn(256, 256)
        b = _square(a)
        return (b @ a).sum()
    assert (functp.estimate(program, 1).peak_bytes ==
            functp.estimate(program, 1, hardware=HW).peak_bytes)


def _square(a):
    t = a @ a          # a temporary that dies with this frame
    return t @ a


def _gpu_step_programs():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                        "gpu_step_programs.py")
    spec = importlib.util.spec_from_file_location("gpu_step_programs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("variant,dp", [("plain tape", 1), ("plain func.grad", 1),
                                        ("functp tape", 1), ("functp func.grad", 1),
                                        ("functp tape", 2)])
def test_a_traced_step_counts_the_python_calls_of_a_warm_real_step(variant, dp):
    """The estimate of a step after a warm-up call (warmup=1) counts the Python calls
    (and C functions called from Python) a warm real step makes, counted by the same
    counter, within 7%. (What is left: under fake tensors transformers takes its
    tracing path, building the causal mask and expanding K/V for SDPA where a real
    step passes no mask; functp's own ops run their fake kernels.) A first step
    (warmup=0) counts functp's first-call work besides, a quarter more. At dp=2 the
    warm real step's gradient buckets follow the order their ranks agreed at the first
    backward, one launch point a bucket; the estimate's rank has no peer to agree
    with, and still counts that step (2,177 against 2,229 calls when measured)."""
    pytest.importorskip("transformers")
    progs = _gpu_step_programs()
    cfg = dict(progs.CONFIGS["host-bound h64 L8 1x8"], layers=2, B=dp)

    def setup():
        return progs.program(cfg, "cpu", variant, torch.float32, dp=dp)

    def warm_real():
        step = setup()
        step()
        step()
        with PyCalls() as real:
            step()
        return real.total + real.builtin
    # (as one simulated rank: run for real here, its mesh would leave a process group
    # initialized in the pytest process, which later tests would take for torchrun's)
    measured = functp.simulate(warm_real, dp, check=False)[0]
    warm = functp.estimate(setup, dp, hardware=HW, warmup=1).seconds.python_calls
    ratio = warm / measured
    assert abs(ratio - 1) < 0.07, (warm, measured)
    if variant.startswith("functp"):
        first = functp.estimate(lambda: setup()(), dp, hardware=HW).seconds.python_calls
        assert first > 1.15 * warm, (first, warm)


def test_warmup_measures_the_last_call_only():
    """warmup=k: the FLOPs, collectives and peak are the measured call's, not the
    program's; a program that returns no step is refused, naming what to return."""
    def program():
        w = torch.randn(64, 64, requires_grad=True)
        return lambda: (torch.ones(8, 64) @ w).sum().backward()
    one = functp.estimate(lambda: program()(), 1)
    warm = functp.estimate(program, 1, warmup=2)
    assert warm.flops == one.flops == 2 * (2 * 8 * 64 * 64)    # forward, w's gradient
    # the gradient the warm-up left is held when the measured step starts
    assert warm.resident_bytes >= 2 * 64 * 64 * 4
    with pytest.raises(functp.ShardingError, match="must return its step"):
        functp.estimate(lambda: torch.ones(2), 1, warmup=1)
