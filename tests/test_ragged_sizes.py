"""ragged_all_to_all checks the sizes its caller hands it before any row moves (issue 41,
item 5): a sender one row short of what its receiver planned left rows of the output
unwritten, one row over aborted the process in gloo (``op.preamble.length <=
op.nbytes``). Now every rank of the axis raises the same ShardingError naming the
sender, the receiver, the rows planned and sent, and the fix; in both check modes, on
2 and 4 ranks, 1-d and 2-d meshes, tape and torch.func.grad. Sizes a
``ragged_offsets`` plan made are not exchanged again (counted with comm_log).

One row short runs simulated; one row over runs in gloo processes (on the old code it
aborts the process that runs it). One dp row short on a 2-d mesh, after a 4-d mesh over
the same process groups, runs in a child process: the check mode's exchange aborted
there (each mesh's collectives took another mesh's check group)."""
from __future__ import annotations

import time

import pytest
import torch

import functp
from functp import P, ShardingError

H = 2


def _mesh(kind: str):
    n = functp.process_count()
    if kind == "4d":        # (its 'dp' and 'ep' groups have the same members as 2d's)
        return functp.make_mesh((1, 2, n // 2, 1), ("pp", "dp", "ep", "tp"))
    return (functp.make_mesh((n,), ("ep",)) if kind == "1d"
            else functp.make_mesh((2, n // 2), ("dp", "ep")))


def _mismatch(kind: str, delta: int, how: str, form: str, only_dp0: bool = False,
              held: int | None = None):
    """Peer 0 sends ``2 + delta`` rows to peer 1 along 'ep', which plans 2; every other
    pair agrees (one row each way); ``held``: that dp row waits 0.3 s before its
    exchange (gloo processes: the other row is inside its exchanges by then). Returns
    each rank's error text, or its output."""
    mesh = _mesh(kind)
    n = mesh.shape["ep"]
    me = mesh.axis_index("ep")
    off = only_dp0 and mesh.axis_index("dp") != 0

    def body(x, b):
        if held is not None and mesh.axis_index("dp") == held:
            time.sleep(0.3)
        send = [1] * n
        recv = [1] * n
        if me == 0 and not off:
            send[1] = 2 + delta
        if me == 1:
            recv[0] = 2
        if me == 0 and off:
            send[1] = 2
        in_off = [sum(send[:j]) for j in range(n)]
        roff = [sum(recv[:j]) for j in range(n)]
        # where this rank's rows land in peer d: after those of the peers before it
        # (peer 1 plans 2 rows from peer 0)
        out_off = [me + (d == 1 and me > 0) for d in range(n)]
        sizes = (in_off, send, out_off, recv)
        if form == "tensors":
            sizes = tuple(torch.tensor(v) for v in sizes)

        def f(x, b):
            return functp.ragged_all_to_all(x, b, *sizes, "ep", recv_offsets=roff)
        if how == "value":
            return f(x, b)
        if how == "grad":
            return torch.func.grad(lambda x, b: f(x, b).sum(), (0, 1))(x, b)[0]
        x = x.detach().requires_grad_()
        return torch.autograd.grad(f(x, b).sum(), x)[0]

    rows = 2 * n + 2
    x = torch.arange(float(rows * H)).reshape(-1, H) + 100 * mesh.axis_index(mesh.axis_names)
    buf = torch.full((rows, H), -7.0)            # this rank's blocks
    spec = P(tuple(mesh.axis_names))
    f = functp.shard_map(body, mesh, in_specs=(spec, spec), out_specs=spec)
    try:
        return f(x, buf).tolist()
    except ShardingError as e:
        return str(e)


def _want(delta: int) -> list[str]:
    sent = 2 + delta
    return [f"peer 0 sends {sent} row{'s' if sent != 1 else ''} to peer 1 (its send_sizes[1]), "
            f"which plans to receive 2 (its recv_sizes[0])", "no row was sent",
            "every rank of the axis raises this", "functp.ragged_offsets"]


def _assert_same_error_everywhere(msgs, delta):
    assert all(isinstance(m, str) for m in msgs), msgs     # (an output: not raised)
    assert len(set(msgs)) == 1, msgs
    for w in _want(delta):
        assert w in msgs[0], msgs[0]


@pytest.mark.parametrize("world,kind", [(2, "1d"), (4, "1d"), (4, "2d")])
@pytest.mark.parametrize("check", [False, True], ids=["check_off", "check_on"])
@pytest.mark.parametrize("how", ["value", "tape", "grad"])
def test_one_row_short_is_the_same_error_on_every_rank(world, kind, check, how):
    # before: the receiver's last planned row kept the buffer's value (-7) or garbage
    form = "tensors" if how == "tape" and world == 4 else "lists"
    msgs = functp.simulate(_mismatch, world, kind, -1, how, form, check=check)
    _assert_same_error_everywhere(msgs, -1)


def _in_processes(check: bool, *args):
    prev = functp.set_debug(check)
    try:
        return _mismatch(*args)
    finally:
        functp.set_debug(prev)


@pytest.mark.parametrize("world,kind,how", [(2, "1d", "grad"), (4, "1d", "tape"),
                                            (4, "2d", "value")])
@pytest.mark.parametrize("check", [False, True], ids=["check_off", "check_on"])
def test_one_row_over_is_the_same_error_on_every_rank_not_an_abort(run, world, kind, how,
                                                                    check):
    # before: gloo's enforce (op.preamble.length <= op.nbytes) terminated the process
    msgs = run(world, _in_processes, check, kind, 1, how, "lists", gloo=True)
    _assert_same_error_everywhere(msgs, 1)


def _assert_told_across_dp(msgs):
    assert all(isinstance(m, str) and _want(-1)[0] in m for m in msgs), msgs
    assert msgs[0] == msgs[1] and msgs[2] == msgs[3], msgs


def test_one_group_short_on_a_2d_mesh_reaches_every_rank_in_the_check_mode():
    # only dp row 0 mismatches: its ep ranks raise the agreed error; the check mode
    # tells dp row 1 (at its next exchange) instead of leaving it waiting
    _assert_told_across_dp(functp.simulate(_mismatch, 4, "2d", -1, "value", "lists", True,
                                           check=True))


@pytest.mark.parametrize("held", [0, 1], ids=["dp0_late", "dp1_late"])
@pytest.mark.parametrize("how", ["value", "grad"])
def test_one_group_short_with_a_dp_row_held_back_in_processes(run, how, held):
    # dp1_late: dp row 0 is already in the exchange that tells the mesh it raised when
    # dp row 1 starts its size check; dp0_late: dp row 1 is in its exchange's check
    # first. Each process group pairs its collectives in the order they were issued, so
    # the order the rows arrive in changes nothing
    _assert_told_across_dp(run(4, _in_processes, True, "2d", -1, how, "lists", True, held,
                               gloo=True))


# -- a second mesh over the same process groups (the abort of the test above) -------------
# In the full suite the test above aborted the pytest process after tests/test_hf_moe.py:
# a 4-d mesh ('dp_replicate', 'efsdp', 'ep', 'tp') made on the same simulated ranks shares
# the 2-d mesh's 'ep' process groups (simulate makes one group per member set), and its
# registration replaced the 2-d mesh's under the same group key. The ragged exchange then
# ran its check-mode fingerprint with the 4-d mesh's check group (8 ints a rank) while
# the ranks that had raised used their mesh's (6 ints), in the same all-gather over the
# whole mesh: gloo's "op.preamble.length <= op.nbytes. 32 vs 24" ended the process.

def _both_meshes():
    """Makes the 2-d mesh, then the 4-d one over the same groups (registered last)."""
    _mesh("2d")
    _mesh("4d")
    return True


def _rows_moved(kind: str):
    """A correct exchange along 'ep' (one row to each peer, the caller's own lists, so
    its sizes are checked): True where every row landed where it should."""
    mesh = _mesh(kind)
    me, n = mesh.axis_index("ep"), mesh.shape["ep"]
    other = mesh.axis_index(tuple(a for a in mesh.axis_names if a != "ep"))

    def body(x, b):
        return functp.ragged_all_to_all(x, b, list(range(n)), [1] * n, [me] * n, [1] * n, "ep",
                                        recv_offsets=list(range(n)))

    spec = P(tuple(mesh.axis_names))
    x = (10 * me + 100 * other + torch.arange(float(n))).reshape(n, 1)    # row j: for peer j
    out = functp.shard_map(body, mesh, in_specs=(spec, spec), out_specs=spec)(
        x, torch.full((n, 1), -7.0))
    # row s came from peer s: its row for this rank
    return out.flatten().tolist() == [10 * s + 100 * other + me for s in range(n)]


def _mesh_by_dp_row():
    """dp row 0 runs a body over the 2-d mesh, dp row 1 the same body over the 4-d mesh
    (a choice of mesh that depends on the rank): each rank's error text, or output."""
    m2, m4 = _mesh("2d"), _mesh("4d")
    mesh = m2 if m2.axis_index("dp") == 0 else m4
    f = functp.shard_map(lambda x: functp.psum(x, "ep"), mesh, in_specs=P("ep"), out_specs=P())
    try:
        return f(torch.ones(2)).tolist()
    except ShardingError as e:
        return str(e)


_CASES = [(check, how, only_dp0) for check in (True, False) for how in ("value", "tape", "grad")
          for only_dp0 in (True, False)]


def _after_a_second_mesh() -> dict:
    """Run in a child process (on the old code it aborted): each case of _CASES on the
    2-d mesh after the 4-d mesh was made, each rank's error text or output; then a
    correct exchange on each mesh, check mode on."""
    assert functp.simulate(_both_meshes, 4, check=False) == [True] * 4
    out = {"cases": [functp.simulate(_mismatch, 4, "2d", -1, how, "lists", only_dp0,
                                     check=check) for check, how, only_dp0 in _CASES]}
    out["moved"] = [functp.simulate(_rows_moved, 4, kind, check=True) for kind in ("2d", "4d")]
    out["by_row"] = functp.simulate(_mesh_by_dp_row, 4, check=True)
    out["moved"] += [functp.simulate(_rows_moved, 4, "2d", check=True)]
    return out


def _in_a_child(fn_name: str, timeout: float = 240.0):
    """``fn_name()`` of this module in a fresh Python process (its own simulated ranks);
    its JSON result, or the exit status and output of a child that crashed or hung."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    here = pathlib.Path(__file__).resolve().parent
    code = (f"import json, sys; sys.path.insert(0, {str(here)!r}); import {pathlib.Path(__file__).stem} "
            f"as t; print('RESULT ' + json.dumps(t.{fn_name}()))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    try:
        out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=here.parent,
                             capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the child hung ({timeout:g} s): {(e.stderr or b'')[-3000:]!r}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    # (a backend's abort says why in stderr's first lines; Python's traceback is last)
    assert out.returncode == 0 and lines, (
        f"the child ended with status {out.returncode}\n{out.stdout[-2000:]}\n"
        f"{out.stderr[:1000]}\n...\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def test_a_second_mesh_over_the_same_groups_keeps_the_check_agreed_not_an_abort():
    # before: the child aborted (the first case: one dp row short, check mode on)
    res = _in_a_child("_after_a_second_mesh")
    for (check, how, only_dp0), msgs in zip(_CASES, res["cases"]):
        case = f"check={check} how={how} only_dp0={only_dp0}: {msgs}"
        if not only_dp0:              # both dp rows short: every rank raises the same
            _assert_same_error_everywhere(msgs, -1)
        elif check:                   # dp row 1 is told at its next exchange
            assert all(isinstance(m, str) and _want(-1)[0] in m for m in msgs), case
            assert msgs[0] == msgs[1] and msgs[2] == msgs[3], case
        else:                         # without it, dp row 1's own exchange is correct
            assert msgs[0] == msgs[1] and isinstance(msgs[0], str), case
            assert _want(-1)[0] in msgs[0], case
            assert all(isinstance(m, list) for m in msgs[2:]), case
    assert res["moved"] == [[True] * 4] * 3, res["moved"]      # the meshes keep working
    # ranks that chose different meshes: the check's rows pair (the same length on any
    # mesh) and every rank raises the same error naming both meshes
    msgs = res["by_row"]
    assert all(isinstance(m, str) for m in msgs) and len(set(msgs)) == 1, msgs
    for w in ("ranks disagree on which mesh they run on", "on Mesh(dp=2, ep=2; cpu)",
              "on Mesh(pp=1, dp=2, ep=2, tp=1; cpu)", "shard_map(<lambda>) entry"):
        assert w in msgs[0], msgs[0]


def _planned(change: str):
    mesh = functp.make_mesh((functp.process_count(),), ("ep",))
    n = mesh.shape["ep"]
    me = mesh.axis_index("ep")
    counts = torch.tensor([[1, 2, 0, 1], [3, 0, 1, 1], [0, 2, 2, 1], [1, 1, 1, 0]])[:n, :n]

    def body(x, b):
        plan = functp.ragged_offsets(counts[me], "ep")
        send, recv = plan.send_sizes, plan.recv_sizes
        if change == "copied":          # the same values, the caller's own lists
            send, recv = list(send), list(recv)
        if change == "changed":         # every rank changes its plan: checked again
            plan.send_sizes[(me + 1) % n] += 1
        with functp.comm_log() as log:
            out = functp.ragged_all_to_all(x, b, plan.input_offsets, send,
                                           plan.output_offsets, recv, "ep",
                                           recv_offsets=plan.recv_offsets)
            # the return trip: the plan's lists swapped (rows back where they came from)
            back = functp.ragged_all_to_all(out, torch.zeros_like(x), plan.recv_offsets,
                                            recv, [0] * n, send, "ep",
                                            recv_offsets=plan.input_offsets)
        return back, log.count("all_gather")

    x = torch.randn(8, H, dtype=torch.float64)
    f = functp.shard_map(body, mesh, in_specs=(P("ep"), P("ep")), out_specs=(P("ep"), P()))
    try:
        back, gathers = f(x, torch.zeros(8, H, dtype=torch.float64))
    except ShardingError as e:
        return str(e)
    rows = int(counts[me].sum())                 # (the blocks are this rank's own)
    assert torch.equal(back[:rows], x[:rows]), (back, x)
    return gathers


@pytest.mark.parametrize("world", [2, 4])
def test_a_plans_own_lists_are_not_exchanged_again(world):
    assert functp.simulate(_planned, world, "plan", check=False) == [0] * world
    # the caller's own lists (even equal ones): one all-gather of sizes per exchange
    assert functp.simulate(_planned, world, "copied", check=False) == [2] * world


def test_a_changed_plan_is_checked_again():
    msgs = functp.simulate(_planned, 2, "changed", check=False)
    assert len(set(msgs)) == 1 and "peer 0 sends 3 rows to peer 1" in msgs[0], msgs


def _uneven():
    """Rank 0 sends 1 row to rank 1, rank 1 sends 2 to rank 0: sizes that agree, but
    differ per rank; returns the number of all-gathers (the size check's)."""
    mesh = functp.make_mesh((2,), ("ep",))
    me = mesh.axis_index("ep")

    def body(x, b):
        send, recv = ([0, 1], [0, 2]) if me == 0 else ([2, 0], [1, 0])
        return functp.ragged_all_to_all(x, b, [0, 0], send, [0, 0], recv, "ep",
                                        recv_offsets=[0, 0])

    f = functp.shard_map(body, mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
    with functp.comm_log() as log:
        f(torch.ones(4, H), torch.zeros(4, H))
    return log.count("all_gather")


def test_an_estimate_issues_the_check_but_does_not_judge_fake_sizes():
    # an estimate's all-gather repeats this rank's row for every peer: judged, the
    # sizes above would look mismatched; its collectives are still a real run's
    assert functp.simulate(_uneven, 2, check=False) == [1, 1]
    est = functp.estimate(_uneven, 2, ranks=[0, 1])
    assert [est[r].comm.count("all_gather") for r in range(2)] == [1, 1]
