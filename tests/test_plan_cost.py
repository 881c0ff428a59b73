"""What ``parallelize``'s apply costs besides vma tracking (issue 39): the module's
parameters swapped in without walking it, module hooks only where a style acts, no
collective op over an axis of size 1 without vma tracking; counted in Python calls of
named functions and in autograd nodes (no timings), with the gradients of the
unsharded model."""
from __future__ import annotations

import copy
import cProfile
import pstats
import warnings

import pytest
import torch
from torch import nn

import functp
from functp import P, ShardingError
from functp.parallel._tp import Colwise, Partial, Replicate, Rowwise
from functp.mapping._param_swap import ParamSwap
from _oracle import assert_tree_close
from test_fast_eager import _graph_ops


def _calls(fn, *names: tuple[str, str]) -> dict:
    """How many times one ``fn()`` calls each ``(file suffix, function name)``."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    got = dict.fromkeys(names, 0)
    for (file, _, name), (_, n, *_) in pstats.Stats(prof).stats.items():
        for suffix, fname in names:
            if name == fname and file.endswith(suffix):
                got[(suffix, fname)] += n
    return got


def _hooked(model: nn.Module) -> tuple[set, set]:
    """The names of the submodules with forward pre-hooks, and with forward hooks."""
    mods = dict(model.named_modules())
    return ({n for n, m in mods.items() if m._forward_pre_hooks},
            {n for n, m in mods.items() if m._forward_hooks})


# -- the parameter swap ---------------------------------------------------------------

class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight        # tied
        self.again = self.mid                     # one module under two names

    def forward(self, ids):
        h = self.again(torch.tanh(self.mid(self.emb(ids))))
        return self.head(h)


def test_param_swap_finds_the_slots_once_and_again_when_parameters_change():
    torch.manual_seed(0)
    model = _Tied().double()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    apply, params = functp.functionalize(model)
    swap = ParamSwap(model)
    assert sorted(params) == ["emb.weight", "mid.bias", "mid.weight"]
    own = dict(model.named_parameters())
    for step in range(3):
        new = {k: v + step for k, v in params.items()}
        undo = swap.swap_in(new)
        assert model.head.weight is new["emb.weight"] and model.mid.bias is new["mid.bias"]
        out = model(ids)
        swap.restore(undo)
        assert all(p is own[n] for n, p in model.named_parameters())
        # (on a copy: torch's own restore leaves a module reached under two names
        # holding the swapped-in tensors, ``again`` here; the swap puts back each once)
        ref = torch.func.functional_call(copy.deepcopy(model), new, (ids,), tie_weights=True)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(apply(new, ids), ref, rtol=0, atol=0)
    assert swap.scans == 1          # functional_call walks the module on every call
    # a parameter replaced (untying the head): found again, once
    model.head.weight = nn.Parameter(model.emb.weight.detach() * 2)
    full = {k: v.detach() for k, v in model.named_parameters()}
    for _ in range(2):
        undo = swap.swap_in(full)
        swap.restore(undo)
    assert swap.scans == 2 and model.head.weight is not model.emb.weight
    torch.testing.assert_close(apply(full, ids), model(ids), rtol=0, atol=0)
    # a dict naming a tied weight's second name is functional_call's: None here
    model.head.weight = model.emb.weight
    assert swap.swap_in({"head.weight": params["emb.weight"]}) is None
    assert swap.swap_in({"nope": params["emb.weight"]}) is None
    assert all(p is q for p, q in zip(model.parameters(), own.values()))


def test_apply_restores_the_parameters_when_the_module_raises():
    model = nn.Linear(3, 2).double()
    apply, params = functp.functionalize(model)
    own = (model.weight, model.bias)
    with pytest.raises(RuntimeError):
        apply(params, torch.ones(2, 5, dtype=torch.float64))
    assert (model.weight, model.bias) == own


# -- a transformers Llama under parallelize("auto") ----------------------------------

def _llama_step_body(shape, check_vma):
    pytest.importorskip("transformers")
    from _hf import BATCH, SEQ, VOCAB, _build, _lm_loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build("llama")
    mesh = functp.make_mesh(shape, ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    ref_apply, full = functp.functionalize(model)
    ref = torch.func.grad(lambda p: _lm_loss(ref_apply(p, ids, use_cache=False).logits, ids))(full)
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    pre, post = _hooked(model)
    step = functp.shard_map(
        lambda p, i: functp.pmean(_lm_loss(apply(p, i, use_cache=False).logits, i), "dp"),
        mesh, in_specs=(specs, P("dp")), out_specs=P(), check_vma=check_vma)
    local_ids = functp.shard(ids, mesh, P("dp"))
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}

    def tape():
        return torch.autograd.grad(step(leaves, local_ids), list(leaves.values()))
    counts = _calls(tape, ("_hooks.py", "pre"), ("_hooks.py", "post"),
                    ("_hooks.py", "_new_call"), ("module.py", "named_modules"),
                    ("_ops.py", "_psum_raw"), ("_collectives.py", "_collective"),
                    ("_hooks.py", "post_work"))
    grads = dict(zip(leaves, tape()))
    # (sum rules on tp=2 differ by float32 rounding, ~1e-6 of the largest gradient, as on
    # main: Llama's RMSNorm computes in float32, and sum rules carry each rank's share
    # of a cotangent through it where vma rules carry the whole)
    tol = dict(rtol=1e-10, atol=1e-10) if check_vma or shape[1] == 1 else dict(rtol=1e-4, atol=1e-7)
    assert_tree_close(apply.unshard(grads), ref, "tape gradients", tol)
    assert_tree_close(apply.unshard(torch.func.grad(step)(params, local_ids)), ref,
                      "torch.func.grad gradients", tol)
    ops = _graph_ops(step(leaves, local_ids))
    return pre, post, counts, apply._swap.scans, ops


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_a_llama_step_hooks_only_where_styles_act(run, check_vma):
    # tp=2: q/k/v/gate/up are colwise with a replicated input and local columns out
    # (nothing at their boundary); o/down rowwise (the all-reduce); the LM head
    # gathers its columns; the embedding (vocab-parallel) acts before and after
    for pre, post, counts, scans, _ in run(2, _llama_step_body, (1, 2), check_vma):
        assert pre == {"model.embed_tokens"}, pre
        assert post == {"model.embed_tokens", "lm_head", *(
            f"model.layers.{i}.{m}" for i in range(2)
            for m in ("self_attn.o_proj", "mlp.down_proj"))}, post
        # one hook call per hook per step (before: 15 pre and 15 post, and the root's);
        # a Call made only for the embedding, whose hooks read the call's parameters.
        # With vma, a replayed step lifts each colwise module's replicated input
        # (Megatron's f) in a pre-hook: q/k/v/gate/up in both layers and the LM head
        assert counts[("_hooks.py", "pre")] == (12 if check_vma else 1)
        assert counts[("_hooks.py", "post")] == 6
        # a replayed step still runs the styles' work where the axis has two ranks
        assert counts[("_hooks.py", "post_work")] == 6
        assert counts[("_hooks.py", "_new_call")] == 1
        # no walk of the module tree in a step (functional_call's untie scan: 70 a step)
        assert counts[("module.py", "named_modules")] == 0
        assert scans == 1
        if not check_vma:
            # psum ops: o_proj's and down_proj's in both layers, the embedding's, and
            # their transposes (sum rules); the loss's pmean over dp (of size 1) is a
            # copy, no op; the vma rules' are the vma tracking's business
            assert counts[("_ops.py", "_psum_raw")] == 10, counts


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "sum"])
def test_size1_axes_cost_no_collective_op(run, check_vma):
    # dp=2, tp=1 (a data-parallel run of the "auto" plan): no relayout over tp is a
    # collective, without vma tracking nor in a replayed step (the one profiled: its
    # vma is tagged at the boundaries as recorded, so no move over one rank needs an
    # op to carry it); the one collective is the loss's pmean over dp
    for _, _, counts, _, ops in run(2, _llama_step_body, (2, 1), check_vma):
        assert counts[("_collectives.py", "_collective")] == 1, counts
        if check_vma:
            # a replayed step runs no style hook over tp of size 1 that is the identity
            # there (o/down_proj's psum, the LM head's gather), only the embedding's,
            # whose masks zero an id outside the vocabulary over one rank too (the
            # gradients above are exact)
            assert counts[("_hooks.py", "post_work")] == 1, counts
            continue            # (its gradient all-reduce: the buckets' aliases)
        assert counts[("_hooks.py", "post_work")] == 6, counts
        # without vma the parameters' gradient all-reduce over dp is one pvary, with
        # no gradient-overlap entry (which it would leave behind)
        assert counts[("_ops.py", "_psum_raw")] == 2, counts    # the loss's, both ways
        assert sum("pvary" in n for n in ops) == 1, ops
        assert not any("overlap_entry" in n for n in ops), ops


def _one_rank_body():
    pytest.importorskip("transformers")
    from _hf import BATCH, SEQ, VOCAB, _build, _lm_loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build("llama")
    mesh = functp.make_mesh((1, 1), ("dp", "tp"))
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    prev = functp.set_overlap(first_bucket_mb=1e-6)       # (any body would enter)
    try:
        out = {}
        for check_vma in (True, False):
            step = functp.shard_map(
                lambda p, i: _lm_loss(apply(p, i, use_cache=False).logits, i), mesh,
                in_specs=(specs, P()), out_specs=P(), check_vma=check_vma)
            leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
            out[check_vma] = _graph_ops(step(leaves, ids))
    finally:
        functp.set_overlap(**prev)
    return out


def test_a_body_over_axes_of_size_1_has_no_boundary_ops(run):
    # every axis of size 1: no gradient can be in flight, no pvary sums anything
    for ops in run(1, _one_rank_body):
        for check_vma, names in ops.items():
            assert not any("overlap_entry" in n or "pvary" in n for n in names), names
        assert not any("psum" in n for n in ops[False]), ops[False]


# -- the seam for a planned module's pre-hook action ----------------------------------

class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.tanh(self.up(self.norm(x))))


def _seam_body():
    torch.manual_seed(0)
    model = _MLP().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    mesh = functp.make_mesh((2,), ("tp",))
    apply, params, specs = functp.parallelize(
        model, mesh, {"norm": "replicated", "up": "colwise", "down": "rowwise"})
    assert _hooked(model) == (set(), {"down"})    # rowwise: the all-reduce, the bias
    seen = []

    def double(module, args, kwargs):             # an action that changes the input
        seen.append(type(module).__name__)
        return (args[0] * 2, *args[1:]), kwargs
    hooks = apply.plan_hooks
    hooks["norm"].add_pre(double)
    hooks["up"].add_pre(lambda m, a, k: seen.append("up"))   # (None: as they are)
    hooks["up"].add_post(lambda m, a, k, out: seen.append(tuple(out.shape)))
    # after the style's prepare_output (the all-reduce, the bias): the whole output
    hooks["down"].add_post(lambda m, a, k, out: out * 3, after=True)
    assert _hooked(model) == ({"norm", "up"}, {"up", "down"})
    step = functp.shard_map(lambda p, x: apply(p, x), mesh, in_specs=(specs, P()),
                            out_specs=P())
    got = step(params, x)
    assert seen == ["LayerNorm", "up", (3, 4)], seen          # (up's local columns)
    assert not torch.equal(model(x), got)         # outside apply: no action
    assert seen == ["LayerNorm", "up", (3, 4)]
    torch.testing.assert_close(got, 3 * model(2 * x), rtol=1e-12, atol=1e-12)
    return True


def test_a_planned_module_takes_a_pre_hook_action_inside_apply_only(run):
    assert all(run(2, _seam_body))


def _idle_body():
    # tp of one rank: a replayed call skips the rowwise psum, not an action added there
    torch.manual_seed(0)
    model = _MLP().double()
    model.down.bias = None
    x = torch.randn(3, 4, dtype=torch.float64)
    mesh = functp.make_mesh((1,), ("tp",))
    apply, params, specs = functp.parallelize(
        model, mesh, {"norm": "replicated", "up": "colwise", "down": "rowwise"})
    hooks = apply.plan_hooks
    assert hooks["down"].replay_idle and not hooks["up"].acting
    step = functp.shard_map(lambda p, x: apply(p, x), mesh, in_specs=(specs, P()),
                            out_specs=P())
    first = [step(params, x), step(params, x)]
    assert apply.replay_status() == ["replayed"]
    hooks["down"].add_post(lambda m, a, k, out: out * 3, after=True)
    assert not hooks["down"].replay_idle
    then = [step(params, x), step(params, x)]
    assert apply.replay_status() == ["replayed"]
    for got, want in zip(first + then, [model(x)] * 2 + [3 * model(x)] * 2):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    return True


def test_a_replay_skips_identity_hooks_over_one_rank_but_not_an_action(run):
    assert all(run(1, _idle_body))


def _embedding_body():
    # over one rank a vocabulary-parallel embedding still checks its ids when replayed,
    # as in its recorded first call and over two ranks: an id outside the vocabulary
    # raises, as in the plain embedding (on a GPU a device-side assert)
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4).double()
    mesh = functp.make_mesh((1,), ("tp",))
    apply, params, specs = functp.parallelize(emb, mesh, {"": "embedding_rowwise"})
    step = functp.shard_map(lambda p, i: apply(p, i), mesh, in_specs=(specs, P()),
                            out_specs=P())
    ids = torch.tensor([[1, 9]])
    outs = [step(params, ids) for _ in range(3)]
    assert apply.replay_status() == ["replayed"]
    for out in outs:
        torch.testing.assert_close(out, emb.weight[torch.tensor([[1, 9]])], rtol=0, atol=0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"outside the vocabulary \[0, 10\)"):
            step(params, torch.tensor([[1, 12]]))
    return True


def test_a_replayed_embedding_over_one_rank_checks_ids_as_its_first_call(run):
    assert all(run(1, _embedding_body))


def test_styles_say_where_they_act():
    lin = nn.Linear(4, 4)
    acts = Colwise().acts(lin, "tp")
    assert acts.pre is None and acts.post is None and not acts.call
    acts = Colwise(output_layout=Replicate()).acts(lin, "tp")
    assert acts.pre is None and acts.post is not None and acts.identity_over_one
    acts = Rowwise().acts(lin, "tp")
    assert acts.pre is None and acts.post is not None and acts.call     # (its bias)
    assert not acts.identity_over_one        # (added after the psum, even over one rank)
    assert not Rowwise().acts(nn.Linear(4, 4, bias=False), "tp").call
    assert Rowwise().acts(nn.Linear(4, 4, bias=False), "tp").identity_over_one
    assert not Colwise(output_layout=Replicate(), packed=2).acts(lin, "tp").identity_over_one

    class Mine(Colwise):       # its own hook: on every call, as written
        def prepare_output(self, module, args, kwargs, output, call):
            return output
    acts = Mine().acts(lin, "tp")
    assert acts.post is not None and acts.call and not acts.identity_over_one
    with pytest.raises(ShardingError, match="Partial"):
        Colwise(
            output_layout=Partial("max")).acts(lin, "tp")
