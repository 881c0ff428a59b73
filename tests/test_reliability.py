"""An error on one rank is an error on every rank: no hangs, no silent wrong answers.

Each case runs on 2 (or 4) ranks, with the cross-rank check mode on and, where it
applies, off, and asserts the outcome: the right values, or the error on every rank
with a message naming the rank and what differed."""
from __future__ import annotations

import os
import random
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import functp
from functp import P, ShardingError

_LIMIT = 30.0      # seconds a case may take to fail


def _sim(fn, n, *args, check=True, timeout=60.0):
    return functp.simulate(fn, n, *args, check=check, timeout=timeout)


def _outcome(fn):
    """(error type or "ok", message or value, notes) of ``fn()`` on this rank."""
    try:
        return "ok", fn(), []
    except Exception as e:      # noqa: BLE001 - the test inspects what each rank got
        return type(e).__name__, str(e), list(getattr(e, "__notes__", []))


def _mesh(kind: str):
    n = functp.process_count()
    return (functp.make_mesh((n,), ("x",)) if kind == "1d" else
            functp.make_mesh((2, n // 2), ("dp", "x")))


# -- 1. a body that raises on one rank ---------------------------------------------------

def _raises_on_rank0(kind, grad):
    mesh = _mesh(kind)
    r = functp.process_index()
    state = {"raise": True}

    def body(a):
        b = functp.psum(a, "x")
        if r == 0 and state["raise"]:
            raise ValueError("boom on rank 0")
        return functp.psum((a * b).sum(), "x")

    f = functp.shard_map(body, mesh, in_specs=P("x"), out_specs=P())
    x = torch.arange(2.0, dtype=torch.float64) + 2 * mesh.axis_index("x")
    call = (lambda: torch.func.grad(f)(x)) if grad else (lambda: f(x))
    first = _outcome(call)
    state["raise"] = False
    second = _outcome(call)        # the mesh works after the agreed error
    return first, second


def _expected_second(n, grad):
    # a = [2i, 2i+1] on rank i; b = psum(a); loss = sum_i a_i . b
    xs = [torch.arange(2.0, dtype=torch.float64) + 2 * i for i in range(n)]
    b = sum(xs)
    return [2 * b if grad else (b * b).sum() for _ in xs]


@pytest.mark.parametrize("world,kind,grad", [(2, "1d", False), (2, "1d", True),
                                             (4, "2d", False)])
def test_body_raising_on_one_rank_is_agreed(world, kind, grad):
    res = _sim(_raises_on_rank0, world, kind, grad)
    (k0, m0, notes0), _ = res[0]
    assert k0 == "ValueError" and m0 == "boom on rank 0", res[0]
    assert any("the other ranks" in n for n in notes0), notes0
    for r, ((k, m, _), _) in enumerate(res[1:], 1):
        assert k == "ShardingError", (r, k, m)
        for w in ("rank 0", "ValueError: boom on rank 0", "test_reliability.py",
                  f"rank {r} stopped at", "the mesh stays usable"):
            assert w in m, f"rank {r}: {w!r} not in {m}"
    n = functp.simulate(lambda: _mesh(kind).axis_size("x"), world)[0]
    want = _expected_second(n, grad)
    for r, (_, (k, v, _)) in enumerate(res):
        assert k == "ok", (r, k, v)
        torch.testing.assert_close(v, want[0], msg=f"rank {r} after the agreed error")


def _raises_on_rank0_processes(debug):
    prev = functp.set_debug(debug)
    try:
        names = ("raise_on", "raise_dp") if debug else ("raise_off", "raise_dp2")
        mesh = functp.make_mesh((dist.get_world_size(), 1), names, timeout=3)
        r = dist.get_rank()

        def body(a):
            b = functp.psum(a, names[0])
            if r == 0:
                raise ValueError("boom on rank 0")
            return functp.psum(b * 2, names[0])

        f = functp.shard_map(body, mesh, in_specs=P(names[0]), out_specs=P(),
                             check_vma=False)
        t0 = time.monotonic()
        kind, msg, _ = _outcome(lambda: f(torch.ones(2)))
        return kind, msg, time.monotonic() - t0
    finally:
        functp.set_debug(prev)


@pytest.mark.discards_pool
@pytest.mark.parametrize("debug", [True, False], ids=["checked", "plain"])
def test_body_raising_on_one_rank_processes(run, debug):
    res = run(2, _raises_on_rank0_processes, debug, gloo=True, last=True)
    assert res[0][0] == "ValueError", res[0]
    kind, msg, secs = res[1]
    assert kind == "ShardingError" and secs < _LIMIT, res[1]
    if debug:           # told at once, at its next check
        assert "rank 0" in msg and "ValueError: boom on rank 0" in msg, msg
        assert secs < 3, secs
    else:               # no check: it waits out the mesh's timeout, and names the psum
        assert "all_reduce(sum) over ('raise_off',)" in msg and "timeout" in msg, msg


# -- 2. the check mode on some ranks only ------------------------------------------------

def _debug_on_rank0_only(when):
    prev = functp.set_debug(True)
    try:
        r = dist.get_rank()
        if when == "make_mesh":
            functp.set_debug(r == 0)
            t0 = time.monotonic()
            kind, msg, _ = _outcome(lambda: functp.make_mesh((2,), ("agree_x",)))
            return kind, msg, time.monotonic() - t0
        mesh = functp.make_mesh((2,), ("agree_y",))
        functp.set_debug(r == 0)
        f = functp.shard_map(lambda a: functp.psum(a, "agree_y"), mesh, in_specs=P("agree_y"),
                             out_specs=P())
        t0 = time.monotonic()
        kind, msg, _ = _outcome(lambda: f(torch.ones(2)))
        return kind, msg, time.monotonic() - t0
    finally:
        functp.set_debug(prev)


@pytest.mark.parametrize("when", ["make_mesh", "shard_map"])
def test_check_mode_on_one_rank_is_an_error_on_both(run, when):
    for r, (kind, msg, secs) in enumerate(run(2, _debug_on_rank0_only, when, gloo=True)):
        assert kind == "ShardingError" and secs < _LIMIT, (r, kind, msg)
        assert "on on ranks [0] and off on ranks [1]" in msg and "FUNCTP_DEBUG" in msg, msg


# -- 3. simulate: a rank that waits outside functp -----------------------------------------

def _polls_for_a_file(path):
    # under torchrun this works: rank 1 writes the file, rank 0 sees it. Simulated ranks
    # take turns at collectives: once rank 1 waits in one (the check mode's exchange at
    # g's entry, so it hands the turn to rank 0 whichever rank got it first), rank 0
    # polls, never handing the turn back, and rank 1 never writes
    mesh = functp.make_mesh((2,), ("x",))
    f = functp.shard_map(lambda a: functp.psum(a, "x"), mesh, in_specs=P("x"), out_specs=P())
    g = functp.shard_map(lambda a: a * 2, mesh, in_specs=P("x"), out_specs=P("x"))
    f(torch.ones(1))
    if functp.process_index() == 1:
        g(torch.ones(1))
        with open(path, "w") as fh:
            fh.write("ready")
    else:
        while not os.path.exists(path):
            time.sleep(0.01)
    return f(torch.ones(1))


def _raises_then_peer_polls(path):
    # rank 1 fails at once; rank 0 waits for a file it would have written: under
    # torchrun the launcher ends rank 0; simulate stops it and reports rank 1's error
    mesh = functp.make_mesh((2,), ("x",))
    if functp.process_index() == 1:
        raise KeyError("rank 1 fails first")
    while not os.path.exists(path):
        time.sleep(0.01)
    return mesh


def test_simulate_names_a_rank_stuck_outside_collectives(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ShardingError) as info:
        _sim(_polls_for_a_file, 2, str(tmp_path / "flag"), check=True, timeout=2)
    msg = str(info.value)
    assert time.monotonic() - t0 < _LIMIT
    assert "rank 0 ran for 2 s without reaching a collective" in msg, msg
    assert "test_reliability.py" in msg and "in _polls_for_a_file" in msg, msg


def test_simulate_stops_a_rank_waiting_for_a_failed_one(tmp_path):
    # whichever rank takes the first turn, the run ends: rank 1's own error when it ran
    # first (rank 0 then stopped), or rank 0 named as stuck when rank 1 never got a turn
    t0 = time.monotonic()
    with pytest.raises((KeyError, ShardingError)) as info:
        _sim(_raises_then_peer_polls, 2, str(tmp_path / "never"), check=False, timeout=2)
    assert time.monotonic() - t0 < _LIMIT
    if isinstance(info.value, KeyError):
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "raised on rank 1" in notes and "rank 0 was then stopped" in notes, notes
    else:
        msg = str(info.value)
        assert "rank 0 ran for 2 s" in msg and "in _raises_then_peer_polls" in msg, msg


def _computes_then_waits(path):
    # rank 1 waits in a collective while rank 0 sits outside one: the error names rank 0
    mesh = functp.make_mesh((2,), ("x",))
    f = functp.shard_map(lambda a: functp.psum(a, "x"), mesh, in_specs=P("x"), out_specs=P())
    if functp.process_index() == 0:
        while not os.path.exists(path):
            time.sleep(0.01)
    return f(torch.ones(1))


@pytest.mark.parametrize("check", [True, False])
def test_simulate_timeout_blames_the_stuck_rank(tmp_path, check):
    with pytest.raises(ShardingError) as info:
        _sim(_computes_then_waits, 2, str(tmp_path / "never"), check=check, timeout=2)
    msg = str(info.value)
    assert msg.startswith("functp.simulate: rank 0 ran for 2 s"), msg
    assert "in _computes_then_waits" in msg, msg


# -- 4. an output declared replicated that is not (check_vma=False) ------------------------

def _unreduced_output(kind):
    mesh = _mesh(kind)
    f = functp.shard_map(lambda a: a.sum(), mesh, in_specs=P("x"), out_specs=P(),
                         check_vma=False)
    return _outcome(lambda: f(torch.ones(2) * (1 + mesh.axis_index("x"))))


@pytest.mark.parametrize("world,kind", [(2, "1d"), (4, "2d")])
def test_output_declared_replicated_is_compared(world, kind):
    for r, (k, msg, _) in enumerate(_sim(_unreduced_output, world, kind)):
        assert k == "ShardingError", (r, k, msg)
        for w in ("differs across ranks", "out_specs P()", "('x',)", "check_vma=False",
                  "psum/pmean"):
            assert w in msg, f"rank {r}: {w!r} not in {msg}"
    # without the check mode nothing notices: each rank returns its own value
    got = _sim(_unreduced_output, world, kind, check=False)
    assert len({float(v) for _, v, _ in got}) > 1, got


# -- 5. shard() of tensors that differ across ranks; full tensors passed as blocks ----------

def _shard_own_random(src):
    mesh = functp.make_mesh((2,), ("x",))
    torch.manual_seed(functp.process_index())      # each rank draws its own "full" tensor
    w = torch.randn(4, 3)
    return _outcome(lambda: functp.shard({"w": w}, mesh, {"w": P("x")}, src_rank=src))


def test_shard_of_differing_full_tensors():
    for r, (k, msg, _) in enumerate(_sim(_shard_own_random, 2, None)):
        assert k == "ShardingError", (r, k, msg)
        for w in ("functp.shard", "['w']", "(4, 3)", "ranks [0, 1]", "src_rank=0",
                  "manual_seed"):
            assert w in msg, f"rank {r}: {w!r} not in {msg}"
    blocks = [v["w"] for _, v, _ in _sim(_shard_own_random, 2, 0)]    # rank 0's, split
    torch.manual_seed(0)
    torch.testing.assert_close(torch.cat(blocks), torch.randn(4, 3))


def _replicated_input_differs():
    mesh = functp.make_mesh((2,), ("x",))
    torch.manual_seed(functp.process_index())
    w = torch.randn(3)
    f = functp.shard_map(lambda w, a: functp.psum(a * w.sum(), "x"), mesh,
                         in_specs=(P(), P("x")), out_specs=P())
    return _outcome(lambda: f(w, torch.ones(2)))


def test_replicated_input_that_differs():
    for r, (k, msg, _) in enumerate(_sim(_replicated_input_differs, 2)):
        assert k == "ShardingError", (r, k, msg)
        for w in ("in_specs for args[0]", "(3,)", "P() says it is replicated over ('x',)",
                  "ranks [0, 1]"):
            assert w in msg, f"rank {r}: {w!r} not in {msg}"


def _full_tensor_as_block():
    mesh = functp.make_mesh((2,), ("x",))
    torch.manual_seed(0)
    w = torch.randn(4, 3)
    f = functp.shard_map(lambda w: functp.psum(w.sum(), "x"), mesh, in_specs=P("x"),
                         out_specs=P(), check_vma=False)
    f(w)                                             # the full tensor: warned

    def of_blocks(w):           # (its own name: a warning is given once per body and leaf)
        return functp.psum(w.sum(), "x")
    functp.shard_map(of_blocks, mesh, in_specs=P("x"), out_specs=P(),
                     check_vma=False)(functp.shard(w, mesh, P("x")))    # not warned


def test_full_tensors_passed_as_blocks_warn():
    # (recorded here: catch_warnings is process-wide, not per simulated rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _sim(_full_tensor_as_block, 2)
    got = [str(x.message) for x in seen if "shard_map" in str(x.message)]
    assert len(got) == 1, got           # once, for the full tensor; not for its block
    assert "Did you pass the full tensor?" in got[0] and "functp.shard" in got[0], got


# -- 6. packed specs in a nested shard_map ------------------------------------------------

def _nested_packed(check_vma, how):
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    w = torch.randn(8, 3, dtype=torch.float64)        # [gate (4 rows); up (4 rows)]
    x = torch.randn(5, 3, dtype=torch.float64)
    spec = P("tp", None, packed={0: 2})
    seen = []

    def inner(wb, x):
        seen.append(wb.detach().clone())
        g, u = wb.chunk(2)                   # this rank's rows of gate, of up
        return functp.psum(((x @ g.T) * (x @ u.T)).sum(), "tp")

    def outer(w, x):
        return functp.shard_map(inner, mesh, in_specs=(spec, P()), out_specs=P(),
                                axis_names=("tp",), check_vma=check_vma)(w, x)

    f = functp.shard_map(outer, mesh, in_specs=(P(), P()), out_specs=P(),
                         axis_names=("dp",), check_vma=check_vma)
    if how == "grad":
        g = torch.func.grad(f)(w, x)
    else:
        wt = w.clone().requires_grad_()
        f(wt, x).backward()
        g = wt.grad
    return seen[0], g


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("how", ["grad", "tape"])
def test_packed_spec_in_a_nested_shard_map(check_vma, how):
    torch.manual_seed(0)
    w = torch.randn(8, 3, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64)
    want = torch.func.grad(lambda w: ((x @ w[:4].T) * (x @ w[4:].T)).sum())(w)
    for r, (block, g) in enumerate(_sim(_nested_packed, 4, check_vma, how)):
        t = r % 2
        torch.testing.assert_close(block, torch.cat([w[2 * t:2 * t + 2], w[4 + 2 * t:6 + 2 * t]]),
                                   msg=f"rank {r}'s block")
        torch.testing.assert_close(g, want, msg=f"rank {r}'s gradient")


# -- 9. remat with the user's generators ---------------------------------------------------

def _noisy(x, g):
    n = torch.randn(x.shape, generator=g, dtype=x.dtype)
    return (torch.sin(x) * n * random.random()).sum()


def _remat_program(remat, how):
    mesh = functp.make_mesh((2,), ("x",))
    g = torch.Generator().manual_seed(1)
    random.seed(3)
    fn = (lambda x: _noisy(x, g))
    fn = functp.checkpoint(fn) if remat else fn
    f = functp.shard_map(lambda x: functp.psum(fn(x), "x"), mesh, in_specs=P("x"),
                         out_specs=P())
    x = torch.arange(4.0, dtype=torch.float64) / 3 + functp.process_index()
    if how == "grad":
        grad = torch.func.grad(f)(x)
    else:
        xt = x.clone().requires_grad_()
        f(xt).backward()
        grad = xt.grad
    # after the step the sources are where the unrematerialized program leaves them
    return grad, g.get_state(), random.random()


@pytest.mark.parametrize("how", ["grad", "tape"])
def test_remat_replays_user_generators(how):
    plain = _sim(_remat_program, 2, False, how)
    remat = _sim(_remat_program, 2, True, how)
    for r, ((g0, s0, p0), (g1, s1, p1)) in enumerate(zip(plain, remat)):
        torch.testing.assert_close(g1, g0, msg=f"rank {r}")
        assert torch.equal(s0, s1) and p0 == p1, f"rank {r}: random state after the step"


# -- 10. cryptic errors made clear ---------------------------------------------------------

def _cryptic(case):
    mesh = functp.make_mesh((2,), ("x",))
    if case == "unshard_packed":
        return functp.unshard(torch.ones(3, 2), mesh, P("x", None, packed={0: 2}))
    if case == "psum_none":
        return functp.shard_map(lambda a: functp.psum(a, None), mesh, in_specs=P("x"),
                                out_specs=P())(torch.ones(2))
    if case == "compile":
        f = functp.shard_map(lambda a: functp.psum(a, "x"), mesh, in_specs=P("x"),
                             out_specs=P(), check_vma=False)
        return torch.compile(f, backend="eager")(torch.ones(2))
    if case == "get_rank":
        return dist.get_rank()
    if case == "all_reduce":
        t = torch.ones(1)
        dist.all_reduce(t)
        return t


_CRYPTIC = {
    "unshard_packed": ["functp.unshard", "packed={0: 2}", "multiple of 4"],
    "psum_none": ["functp.psum(None)", "axis_name", "got None"],
    "compile": ["torch.compile inside functp.simulate is not supported"],
    "get_rank": ["torch.distributed.get_rank", "functp.process_index()"],
    "all_reduce": ["torch.distributed.all_reduce", "functp.psum"],
}


@pytest.mark.parametrize("case", list(_CRYPTIC))
def test_cryptic_errors_are_clear(case):
    with pytest.raises(ShardingError) as info:
        _sim(_cryptic, 2, case)
    for w in _CRYPTIC[case]:
        assert w in str(info.value), f"{w!r} not in {info.value}"


# -- 11. the same collective reached from two source lines ---------------------------------

def _two_branches():
    mesh = functp.make_mesh((2,), ("x",))

    def body(a):
        if functp.axis_index("x") == 0:
            s = functp.psum(a, "x")
        else:
            s = functp.psum(a, "x")
        return s

    return functp.shard_map(body, mesh, in_specs=P("x"), out_specs=P(),
                            check_vma=False)(torch.ones(2))


def test_same_collective_from_two_lines_is_no_divergence():
    for v in _sim(_two_branches, 2):
        torch.testing.assert_close(v, torch.full((2,), 2.0))
