"""functp.simulate: ranks as threads of this process, against the same programs on
gloo processes (bit for bit), and what a user sees when ranks fail or disagree."""
from __future__ import annotations

import math
import random
import time

import optree
import pytest
import torch

import functp
import _programs
from functp import P, ShardingError
from _oracle import recording

# the collective oracle programs: (collective, options), run over every group below
_COLLECTIVES = [("psum", {}), ("pmean", {}), ("pmax", {}), ("pmin", {}),
                ("all_gather", {"axis": 0, "tiled": True}),
                ("all_gather", {"axis": 1, "tiled": False}),
                ("all_gather_invariant", {"axis": 0, "tiled": True}),
                ("psum_scatter", {"dim": 0, "tiled": True}),
                ("psum_scatter", {"dim": 1, "tiled": False}),
                ("all_to_all", {"split": 1, "concat": 0, "tiled": True}),
                ("all_to_all", {"split": 0, "concat": 1, "tiled": False}),
                ("ppermute", {"perm": _programs._ring}),
                ("ppermute", {"perm": _programs._one_pair})]
# every collective on 2 and 4 ranks (from 3 ranks on, the order of a sum's terms
# matters; 8 gloo processes would take 12 s to start on 2 cores)
_GROUPS = {"2-x": ((2,), ("x",), ("x",), len(_COLLECTIVES)),
           "4-x": ((4,), ("x",), ("x",), 4),
           "2x2-b+a": ((2, 2), ("a", "b"), ("b", "a"), len(_COLLECTIVES))}


def _collective_programs(shape, names, axes, k):
    out = []
    for name, kw in _COLLECTIVES[::len(_COLLECTIVES) // k][:k]:
        with recording() as got:
            _programs._collective_body(shape, names, axes, name, kw, True)
        out += got
    return out


# the layout oracle programs, per world size: (body, its first argument)
_LAYOUTS = {2: [(_programs._dp_body, 2), (_programs._ring_body, 2),
                (_programs._ulysses_body, 2)],
            4: [(_programs._fsdp_body, 4), (_programs._megatron_body, 4),
                (_programs._sp_body, 4), (_programs._two_d_body, (2, 2)),
                (_programs._multi_axis_body, (2, 2)), (_programs._ring_body, 4)]}


def _layout_programs(n):
    out = []
    for body, arg in _LAYOUTS[n]:
        for check_vma in (True, False):
            with recording() as got:
                body(arg, check_vma)
            out += got
    return out


def _assert_bitwise(sim, gloo, what):
    assert len(sim) == len(gloo)
    for rank, (a, b) in enumerate(zip(sim, gloo)):
        la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
        assert len(la) == len(lb) and la, f"{what}: rank {rank} recorded nothing"
        for i, (x, y) in enumerate(zip(la, lb)):
            assert torch.equal(x, y), f"{what}: rank {rank}, value {i} differs"


@pytest.mark.parametrize("group", list(_GROUPS.values()), ids=list(_GROUPS))
def test_collective_programs_bitwise_equal_to_gloo(run, group):
    n = math.prod(group[0])
    sim = functp.simulate(_collective_programs, n, *group)
    assert len(sim[0]) == group[3]
    _assert_bitwise(sim, run(n, _collective_programs, *group, gloo=True), str(group))


@pytest.mark.parametrize("n", [2, 4])
def test_layout_programs_bitwise_equal_to_gloo(run, n):
    sim = functp.simulate(_layout_programs, n, n)
    assert len(sim[0]) == 2 * len(_LAYOUTS[n])
    _assert_bitwise(sim, run(n, _layout_programs, n, gloo=True), f"layouts on {n}")


# --- what each rank sees ------------------------------------------------------------

def _rank_facts():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    return (functp.process_index(), functp.process_count(), mesh.coordinate,
            torch.randn(3), random.random(), torch.get_default_dtype())


def test_each_rank_is_like_a_process():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    dtype = torch.get_default_dtype()
    facts = functp.simulate(_rank_facts, 4)
    assert [f[0] for f in facts] == [0, 1, 2, 3]
    assert {f[1] for f in facts} == {4}
    assert [f[2] for f in facts] == [{"dp": r // 2, "tp": r % 2} for r in range(4)]
    # seeded draws agree on every rank although the ranks share one process
    assert all(torch.equal(f[3], facts[0][3]) for f in facts)
    assert len({f[4] for f in facts}) == 1
    assert torch.equal(torch.get_rng_state(), before), "the caller's generator is untouched"
    assert torch.get_default_dtype() == dtype


def _set_dtype_then_collect():
    mesh = functp.make_mesh((2,), ("x",))
    if functp.process_index() == 1:
        torch.set_default_dtype(torch.float64)
    ones = functp.shard(torch.ones(4), mesh, P("x"))     # a collective-free step
    f = functp.shard_map(lambda b: functp.psum(b.sum(), "x"), mesh, in_specs=P("x"),
                         out_specs=P(), check_vma=False)
    f(ones.float())                                        # hands the baton over
    return torch.get_default_dtype()


def test_default_dtype_is_per_rank():
    assert functp.simulate(_set_dtype_then_collect, 2) == [torch.float32, torch.float64]
    assert torch.get_default_dtype() == torch.float32


def _fails_on_rank(bad):
    mesh = functp.make_mesh((4,), ("x",))
    if functp.process_index() == bad:
        raise ValueError(f"bad data on rank {bad}")
    f = functp.shard_map(lambda b: functp.psum(b, "x"), mesh, in_specs=P("x"), out_specs=P())
    return f(torch.ones(2))


def test_an_error_on_one_rank_names_it_and_does_not_hang():
    t = time.monotonic()
    with pytest.raises(ValueError, match="bad data on rank 2") as e:
        functp.simulate(_fails_on_rank, 4, 2, timeout=60)
    assert time.monotonic() - t < 20, "the other ranks waited for the timeout"
    assert "raised on rank 2 of functp.simulate(..., 4)" in e.value.__notes__[0]
    # the run that failed is discarded; the next one starts clean
    assert functp.simulate(_fails_on_rank, 4, -1)[0].shape == (2,)


def _skips_a_collective():
    mesh = functp.make_mesh((2,), ("x",))
    if functp.process_index() == 1:
        return "skipped"
    f = functp.shard_map(lambda b: functp.psum(b, "x"), mesh, in_specs=P("x"), out_specs=P())
    return f(torch.ones(2))


@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
def test_a_skipped_collective_fails_fast(check):
    t = time.monotonic()
    with pytest.raises(ShardingError) as e:
        functp.simulate(_skips_a_collective, 2, check=check, timeout=60)
    assert time.monotonic() - t < 20
    assert any("had returned while the others waited" in n for n in e.value.__notes__)


def _disagree():
    mesh = functp.make_mesh((2,), ("x",))
    dtype = torch.float64 if functp.process_index() == 0 else torch.float32
    f = functp.shard_map(lambda b: functp.psum(b, "x"), mesh, in_specs=P("x"), out_specs=P())
    return f(torch.ones(2, dtype=dtype))


def test_ranks_that_disagree_are_described():
    with pytest.raises(ShardingError, match="ranks disagree") as e:
        functp.simulate(_disagree, 2)
    assert "torch.float64" in str(e.value) and "torch.float32" in str(e.value)


def _needs_default_group(what):
    mesh = functp.make_mesh((2,), ("x",))
    if what == "dtensor":
        functp.to_dtensor(torch.ones(2), mesh, P("x"))
    elif what == "save":
        functp.save("/nonexistent", {"w": torch.ones(2)}, mesh, P("x"))
    else:
        functp.simulate(lambda: 0, 2)


@pytest.mark.parametrize("what,words", [("dtensor", "functp.to_dtensor is not available"),
                                        ("save", "functp.save is not available"),
                                        ("nested", "inside a simulated rank")])
def test_what_simulate_cannot_do_is_said(what, words):
    with pytest.raises(ShardingError, match=words):
        functp.simulate(_needs_default_group, 2, what)


def test_bad_nprocs():
    with pytest.raises(ShardingError, match="nprocs must be a positive int"):
        functp.simulate(lambda: 0, 0)


# --- looking at values ----------------------------------------------------------------

def _print_blocks():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    w = functp.shard(torch.arange(8.0).reshape(2, 4), mesh, P(None, "tp"))

    def body(w):
        functp.print_ranks("block", w)
        return functp.psum(w.sum(), "tp")
    total = torch.func.grad(functp.shard_map(body, mesh, in_specs=P(None, "tp"),
                                             out_specs=P()))(w)
    functp.print_ranks(functp.process_index() * 10)
    return total


def test_print_ranks_prints_once_in_rank_order(capsys):
    functp.simulate(_print_blocks, 4)
    assert capsys.readouterr().out == (
        "[ranks 0, 2] block tensor([[0., 1.],\n"
        "                           [4., 5.]])\n"
        "[ranks 1, 3] block tensor([[2., 3.],\n"
        "                           [6., 7.]])\n"
        "[rank 0] 0\n[rank 1] 10\n[rank 2] 20\n[rank 3] 30\n")


def _mesh_2x2():
    return functp.make_mesh((2, 2), ("dp", "tp"))


def test_visualize_sharding():
    mesh = functp.simulate(_mesh_2x2, 4)[0]
    assert functp.visualize_sharding(torch.zeros(4, 6), P("dp", "tp"), mesh) == (
        "float32[4, 6] as P('dp', 'tp') on Mesh(dp=2, tp=2; cpu)\n"
        "          [:, 0:3]  [:, 3:6]\n"
        "[0:2, :]  rank 0    rank 1\n"
        "[2:4, :]  rank 2    rank 3")
    assert functp.visualize_sharding((5,), P("tp"), mesh) == (
        "shape [5] as P('tp') on Mesh(dp=2, tp=2; cpu)\n"
        "  [0:3]       [3:5]\n"
        "  ranks 0, 2  ranks 1, 3")
    assert functp.visualize_sharding((2, 3, 4), P(None, None, ("dp", "tp")), mesh) == (
        "shape [2, 3, 4] as P(None, None, ('dp', 'tp')) on Mesh(dp=2, tp=2; cpu)\n"
        "[:, :, 0:1]  rank 0\n[:, :, 1:2]  rank 1\n[:, :, 2:3]  rank 2\n[:, :, 3:4]  rank 3")
    # (normalize_spec's message, as for every other spec longer than its tensor)
    with pytest.raises(ShardingError, match=r"visualize_sharding \(shape \(4,\)\): P\('dp', "
                                            r"'tp'\) has 2 entries but the tensor has 1"):
        functp.visualize_sharding((4,), P("dp", "tp"), mesh)


def _logged():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    f = functp.shard_map(lambda b: functp.psum(b.sum(), ("dp", "tp")), mesh,
                         in_specs=P(("dp", "tp")), out_specs=P())
    with functp.comm_log() as log:
        torch.func.grad(f)(torch.ones(3))
    return log.summary()


def test_comm_log_is_per_rank():
    assert functp.simulate(_logged, 4) == [{("all_reduce", ("dp", "tp")): 1}] * 4


def _jvp_of_a_collective():
    mesh = functp.make_mesh((2,), ("x",))
    f = functp.shard_map(lambda b: functp.psum(b, "x"), mesh, in_specs=P("x"), out_specs=P())
    return torch.func.jvp(f, (torch.ones(2),), (torch.ones(2),))


def test_forward_mode_ad_is_refused_with_a_reason():
    with pytest.raises(ShardingError, match="forward-mode AD .* cannot run inside functp.simulate"):
        functp.simulate(_jvp_of_a_collective, 2)


def _compiled(check_vma):
    mesh = functp.make_mesh((2,), ("x",))
    f = functp.shard_map(lambda b: functp.psum(b.sum(), "x"), mesh, in_specs=P("x"),
                         out_specs=P(), check_vma=check_vma)
    torch._dynamo.reset()
    return torch.compile(f, fullgraph=True, backend="aot_eager")(torch.ones(2))


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_torch_compile_is_refused_with_a_reason_not_a_hang(check_vma):
    # (a vma body is traced as Python on fake tensors, where a simulated rank's
    # collective would wait for its peers: it hung until the refusal came first)
    with pytest.raises(Exception, match="torch.compile inside functp.simulate is not supported"):
        functp.simulate(_compiled, 2, check_vma, timeout=60)


def _timeout_of_mesh(seconds):
    mesh = functp.make_mesh((2,), ("x",), timeout=seconds)
    return mesh.timeout.total_seconds()


def test_a_timeout_set_by_a_program_ends_with_it():
    assert functp.simulate(_timeout_of_mesh, 2, 5) == [5.0, 5.0]
    assert functp.simulate(_timeout_of_mesh, 2, None, timeout=30) == [30.0, 30.0]


def _tags_after_a_raise():
    mesh = functp.make_mesh((2,), ("x",))
    x, w = torch.ones(4), torch.ones(3, requires_grad=True)

    def body(a, b):
        functp.psum(a.sum() * b, "x")
        raise ValueError("the body's own error")

    f = functp.shard_map(body, mesh, in_specs=(P("x"), P()), out_specs=P())
    with pytest.raises(ValueError, match="the body's own error"):
        f(x, w)
    return sorted(k for t in (x, w) for k in t.__dict__ if k.startswith("_functp"))


def test_a_body_that_raises_leaves_no_vma_tag_on_its_inputs():
    # (a tag left in an input's __dict__ would be kept by torch.save)
    assert functp.simulate(_tags_after_a_raise, 2) == [[], []]
