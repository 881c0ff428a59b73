"""Plans and parallel styles, one by one, against the unsharded float64 module:
colwise/rowwise (gather_output, split_input, bias after the reduction), vocab-parallel
and hidden-sharded embeddings, packed gate_up weights, sequence parallel, activation
relayouts (prepare_input/output), replicated norms, expert parallel MoE (masked and
all_to_all dispatch), custom styles, plan matching, verification warnings, errors."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import functp
from functp import P
from functp.parallel._style import relayout
from _oracle import assert_tree_close, check_program, comm_stats, randn

H, F, B, S = 8, 16, 2, 4


def _seeded(make):
    torch.manual_seed(0)
    return make().double()


def _check(mesh, module, plan, args, arg_specs, loss, local_loss=None, *, axis="tp",
           dp=None, check_vma=True):
    """Loss and every parameter's gradient of the parallelized module equal the
    unsharded module's; returns the comm stats of the sharded step."""
    ref_apply, full = functp.functionalize(module)
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p, *a: loss(ref_apply(p, *a)))(full, *args)
    apply, local, specs = functp.parallelize(module, mesh, plan, axis=axis)
    local_loss = local_loss or loss

    def body(p, *a):
        out = local_loss(apply(p, *a))
        return functp.pmean(out, dp) if dp else out
    step = functp.shard_map(body, mesh, in_specs=(specs, *arg_specs), out_specs=P(),
                            check_vma=check_vma)
    local_args = [functp.shard(a, mesh, s) for a, s in zip(args, arg_specs)]
    with functp.comm_log() as log:
        grads, value = torch.func.grad_and_value(step)(local, *local_args)
    assert_tree_close(value, ref_loss, "loss")
    assert_tree_close(apply.unshard(grads), ref_grads, "grad")
    return comm_stats(log)


def _sq(out):
    return (out ** 2).sum()


def _tp_mesh(n=2):
    return functp.make_mesh((n,), ("tp",))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, F), nn.Linear(F, H)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


# -- colwise / rowwise -------------------------------------------------------------

def _megatron_mlp():
    stats = _check(_tp_mesh(), _seeded(MLP), {"fc1": "colwise", "fc2": "rowwise"},
                   (randn(B, H, seed=1),), (P(),), _sq)
    return stats


def test_colwise_then_rowwise_is_megatron_with_one_all_reduce(run):
    # the input's replication needs no hook (vma's implicit pvary), and the row-parallel
    # bias is added once, after the one forward all-reduce
    assert run(2, _megatron_mlp)[0] == {"all_reduce:tp": (1, B * H * 8)}


def _gather_output():
    lin = _seeded(lambda: nn.Linear(H, F))
    return _check(_tp_mesh(), lin, {"": "colwise_gather_output"},
                  (randn(B, H, seed=1),), (P(),), lambda y: (y.sin() ** 2).sum())


def test_colwise_gather_output(run):
    # all-gather forward; the gathered value is invariant, so backward takes the slice
    assert run(2, _gather_output)[0] == {"all_gather:tp": (1, B * F // 2 * 8)}


def _split_input():
    lin = _seeded(lambda: nn.Linear(F, H))
    return _check(_tp_mesh(), lin, {"": "rowwise_split_input"}, (randn(B, F, seed=1),),
                  (P(),), _sq)


def test_rowwise_split_input_keeps_this_ranks_slice(run):
    assert run(2, _split_input)[0] == {"all_reduce:tp": (1, B * H * 8)}


# -- embeddings ----------------------------------------------------------------------

class Embed(nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(12, H, padding_idx=padding_idx)
        self.out = nn.Linear(H, H)

    def forward(self, ids):
        return self.out(self.emb(ids))


def _ids():
    return torch.tensor([[0, 3, 5, 6], [11, 7, 2, 6]])     # every rank's rows, repeats


def _vocab_parallel(padding_idx, n):
    torch.manual_seed(0)
    m = Embed(padding_idx).double()
    return _check(_tp_mesh(n), m, {"emb": "embedding_rowwise", "out": "replicated"},
                  (_ids(),), (P(),), lambda y: (y.tanh() ** 2).sum())


@pytest.mark.parametrize("padding_idx", [None, 7])
def test_vocab_parallel_embedding(run, padding_idx):
    # ids outside this rank's rows are masked to zero, then one all-reduce; the padding
    # row (held by rank 1) gets no gradient, as in the unsharded module
    assert run(2, _vocab_parallel, padding_idx, 2)[0] == {"all_reduce:tp": (1, B * S * H * 8)}


def _hidden_sharded_embedding():
    m = _seeded(Embed)
    return _check(_tp_mesh(), m, {"emb": "embedding_colwise", "out": "replicated"},
                  (_ids(),), (P(),), lambda y: (y.tanh() ** 2).sum())


def test_hidden_sharded_embedding(run):
    assert run(2, _hidden_sharded_embedding)[0] == {"all_gather:tp": (1, B * S * H // 2 * 8)}


# -- packed gate_up --------------------------------------------------------------------

class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(H, 2 * F)
        self.down = nn.Linear(F, H)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def _packed_colwise():
    mesh = _tp_mesh()
    m = _seeded(SwiGLU)
    _check(mesh, m, {"gate_up": "packed_colwise", "down": "rowwise"},
           (randn(B, H, seed=1),), (P(),), _sq)
    apply, local, specs = functp.parallelize(m, mesh, {"gate_up": "packed_colwise",
                                                       "down": "rowwise"})
    full = dict(m.named_parameters())
    # this rank holds its slice of gate and the matching slice of up
    i, f = functp.make_mesh((2,), ("tp",)).coordinate["tp"], F // 2
    w = full["gate_up.weight"]
    torch.testing.assert_close(local["gate_up.weight"],
                               torch.cat([w[i * f:(i + 1) * f], w[F + i * f:F + (i + 1) * f]]))
    # the spec says so (packed={0: 2}), so functp.unshard, like apply.unshard, gives
    # back the canonical [gate; up], and shard gives this rank's two slices
    assert specs["gate_up.weight"].packed == ((0, 2),)
    assert_tree_close(apply.unshard(local), {k: v.detach() for k, v in full.items()}, "unshard")
    plain = functp.unshard(local["gate_up.weight"], mesh, specs["gate_up.weight"])
    assert torch.equal(plain, w.detach())
    assert torch.equal(functp.shard(w.detach(), mesh, specs["gate_up.weight"]),
                       local["gate_up.weight"])
    # resharding to replicated and back goes through the canonical tensor
    whole = functp.reshard(local["gate_up.weight"], mesh, specs["gate_up.weight"], P())
    assert torch.equal(whole, w.detach())
    back = functp.reshard(whole, mesh, P(), specs["gate_up.weight"])
    assert torch.equal(back, local["gate_up.weight"])


def test_packed_colwise_gives_matching_gate_and_up_slices(run):
    run(2, _packed_colwise)


def _packed_gather_output():
    plan = {"gate_up": functp.Colwise(packed=2, output_layout=Replicate()),
            "down": "replicated"}
    return _check(_tp_mesh(), _seeded(SwiGLU), plan, (randn(B, H, seed=1),), (P(),), _sq)


def test_packed_colwise_gathered_output_is_in_canonical_order(run):
    assert run(2, _packed_gather_output)[0] == {"all_gather:tp": (1, B * F * 8)}


class PackedPair(nn.Module):
    """A packed activation [gate | up] consumed whole by the next layer."""
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(H, 2 * F), nn.Linear(2 * F, H)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _packed_rowwise(plan_b, plan_a="packed_colwise"):
    try:
        _check(_tp_mesh(), _seeded(PackedPair), {"a": plan_a, "b": plan_b},
               (randn(B, H, seed=1),), (P(),), _sq)
    except AssertionError:       # raised identically on every rank (the loss is replicated)
        return "mismatch"
    return "match"


def test_packed_rowwise_consumes_a_packed_activation(run):
    assert run(2, _packed_rowwise, "packed_rowwise") == ["match"] * 2
    assert run(2, _packed_rowwise, "rowwise") == ["mismatch"] * 2    # slices the wrong columns
    # a replicated packed input, split the packed way (split_input)
    split = functp.Rowwise(packed=2, input_layout=Replicate())
    assert run(2, _packed_rowwise, split, "replicated") == ["match"] * 2


# -- sequence parallel ------------------------------------------------------------------

class SPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, F), nn.Linear(F, H)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


SP_PLAN = {"norm": "sequence_parallel", "fc1": "colwise", "fc2": "rowwise_sp"}


def _sequence_parallel(check_vma):
    m = _seeded(SPBlock)
    with torch.no_grad():
        m.norm.weight.add_(randn(H, seed=5))       # a norm weight with a real gradient
    return _check(_tp_mesh(), m, SP_PLAN, (randn(B, S, H, seed=1),), (P(None, "tp"),), _sq,
                  lambda y: functp.psum(_sq(y), "tp"), check_vma=check_vma)


def test_sequence_parallel_all_gather_in_reduce_scatter_out(run):
    stats = run(2, _sequence_parallel, True)[0]
    # forward: all_gather into the TP region, reduce_scatter out of it; backward: the
    # transposes; then the loss's psum and one bucketed all-reduce of the replicated
    # norm/bias gradients
    assert stats["all_gather:tp"][0] == 2 and stats["reduce_scatter:tp"][0] == 2
    assert stats["all_reduce:tp"][0] == 2, stats


def test_sequence_parallel_without_vma_gives_the_same_gradients(run):
    run(2, _sequence_parallel, False)


# -- relayouts: prepare_input / prepare_output ----------------------------------------------

_LAYOUT_CASES = {
    "shard->replicate": (Shard(0), Replicate(), P("tp"), P()),
    "shard->shard": (Shard(0), Shard(1), P("tp"), P(None, "tp")),
    "replicate->shard": (Replicate(), Shard(1), P(), P(None, "tp")),
    "partial->replicate": (Partial(), Replicate(), P("tp"), P()),
    "partial->shard": (Partial(), Shard(1), P("tp"), P(None, "tp")),
}


def _relayout(case):
    src, dst, x_spec, w_spec = _LAYOUT_CASES[case]
    mesh = _tp_mesh()
    n = 2
    partial = isinstance(src, Partial)
    x, w = randn(n * B, H, seed=1), randn(B if partial else n * B, H, seed=2)

    def glob(x, w):      # a Partial value's global value is the sum of its blocks
        return ((x.view(n, B, H).sum(0) if partial else x).sin() * w).sum()

    def local(x, w):
        y = relayout(x, src, dst, "tp")
        out = (y.sin() * w).sum()
        return out if isinstance(dst, Replicate) else functp.psum(out, "tp")
    check_program(mesh, glob, local, (x, w), (x_spec, w_spec))


@pytest.mark.parametrize("case", sorted(_LAYOUT_CASES))
def test_activation_relayouts(run, case):
    run(2, _relayout, case)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(H, H)

    def forward(self, x):
        return self.inner(x).tanh()


def _prepare_input_output():
    # a batch-sharded input gathered for a replicated layer, whose output is then split
    # by features: the body's loss sums this rank's features
    plan = {"": functp.PrepareInput(Shard(0), Replicate()),
            "inner": functp.PrepareOutput(Replicate(), Shard(1))}
    return _check(_tp_mesh(), _seeded(Outer), plan, (randn(2 * B, H, seed=1),), (P("tp"),),
                  _sq, lambda y: functp.psum(_sq(y), "tp"))


def test_prepare_input_and_prepare_output(run):
    stats = run(2, _prepare_input_output)[0]
    assert stats["all_gather:tp"][0] == 1


# -- replicated parameters between sharded ones ---------------------------------------------

class HeadNormAttn(nn.Module):
    """Per-head q_norm between a column- and a row-parallel layer (Qwen3 / OLMo2):
    transformers needs a gradient all-reduce hook for its weight."""
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(H, H)
        self.q_norm = nn.LayerNorm(2)        # over head_dim 2: 4 heads
        self.o = nn.Linear(H, H)

    def forward(self, x):
        q = self.q(x).view(x.shape[0], -1, 2)
        return self.o(self.q_norm(q).flatten(1))


def _replicated_norm():
    m = _seeded(HeadNormAttn)
    with torch.no_grad():
        m.q_norm.weight.add_(randn(2, seed=4))
    return _check(_tp_mesh(), m, {"q": "colwise", "q_norm": "replicated", "o": "rowwise"},
                  (randn(B, H, seed=1),), (P(),), _sq)


def test_replicated_norm_needs_no_gradient_hook(run):
    stats = run(2, _replicated_norm)[0]
    # one forward all-reduce and one bucketed all-reduce of the q_norm gradients
    assert stats["all_reduce:tp"][0] == 2


# -- data parallel x tensor parallel -------------------------------------------------------------

def _dp_tp():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    return _check(mesh, _seeded(MLP), {"fc1": "colwise", "fc2": "rowwise"},
                  (randn(4, H, seed=1),), (P("dp"),), lambda y: (y ** 2).mean(), dp="dp")


def test_dp_tp_gradients_are_averaged_over_dp_without_a_wrapper(run):
    stats = run(4, _dp_tp)[0]
    assert stats["all_reduce:tp"][0] == 1
    # the loss's pmean, then every parameter's gradient in one dp bucket
    assert stats["all_reduce:dp"][0] == 2, stats


# -- mixture of experts --------------------------------------------------------------------------

def _moe():
    from functp.models.llama import LlamaConfig, LlamaMoE
    return _seeded(lambda: LlamaMoE(LlamaConfig(hidden_size=H, intermediate_size=F, num_experts=4,
                                                  num_experts_per_tok=2)))


def _moe_masked():
    return _check(_tp_mesh(), _moe(), {"router": "ep_router", "experts": "ep_experts"},
                  (randn(B, S, H, seed=1),), (P(),), _sq)


def test_expert_parallel_masked_routing(run):
    # forward: the partial expert outputs; backward: the routing weights' cotangent
    # (they meet every rank's experts: transformers' all_reduce_backward, here vma's)
    k = 2
    assert run(2, _moe_masked)[0] == {"all_reduce:tp": (2, (B * S * H + B * S * k) * 8)}


class TokensThenMoE(nn.Module):
    """A layer before the MoE block, so the dispatched tokens carry gradients too."""
    def __init__(self, moe):
        super().__init__()
        self.lin, self.moe = nn.Linear(H, H), moe

    def forward(self, x):
        return self.moe(self.lin(x).tanh())


def _moe_dispatch(dispatch):
    mesh = functp.make_mesh((2,), ("ep",))
    m = TokensThenMoE(_moe()).double()
    plan = {"lin": "replicated", "moe.router": "replicated",
            "moe.experts": functp.ExpertDispatch(dispatch=dispatch)}
    return _check(mesh, m, plan, (randn(2 * B, S, H, seed=1),), (P("ep"),),
                  lambda y: (y ** 2).mean(), axis="ep", dp="ep")


def test_expert_parallel_ragged_dispatch_of_sharded_tokens(run):
    stats = run(2, _moe_dispatch, "ragged")[0]
    # one all-gather of the per-expert counts; forward: tokens, results; backward: both
    assert stats["all_gather:ep"][0] == 1 and stats["ragged_all_to_all:ep"][0] == 4, stats
    assert "all_to_all:ep" not in stats


def test_expert_parallel_padded_dispatch_of_sharded_tokens(run):
    stats = run(2, _moe_dispatch, "padded")[0]
    # forward: tokens, expert ids, results; backward: results and tokens (ids are ints)
    assert stats["all_to_all:ep"][0] == 5, stats


# -- custom styles ----------------------------------------------------------------------------

class GatheredColwise(functp.Style):
    def param_specs(self, module, axis):
        return {"weight": P(axis, None), "bias": P(axis)}

    def prepare_output(self, module, args, kwargs, output, call):
        return functp.all_gather_invariant(output, call.axis, axis=-1, tiled=True)


def _custom_style():
    functp.register_style("test_gathered_colwise", GatheredColwise(), overwrite=True)
    with pytest.raises(functp.ShardingError, match="exists"):
        functp.register_style("test_gathered_colwise", GatheredColwise())
    lin = _seeded(lambda: nn.Linear(H, F))
    return _check(_tp_mesh(), lin, {"": "test_gathered_colwise"}, (randn(B, H, seed=1),),
                  (P(),), lambda y: (y.sin() ** 2).sum())


def test_custom_style_by_registered_name(run):
    assert run(2, _custom_style)[0] == {"all_gather:tp": (1, B * F // 2 * 8)}


# -- plan matching and verification ----------------------------------------------------------------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(2))
        self.head = nn.Linear(H, 4)


def test_wildcards_match_one_component_and_exact_names_win():
    plan = {"layers.*.fc1": "colwise", "layers.1.fc1": "replicated", "*.fc2": "rowwise",
            "layers.*": "replicated", "nothing.*": "colwise"}
    matched, unused = functp.match_plan(Net(), plan)
    assert {k: v[0] for k, v in matched.items()} == {
        "layers.0": "layers.*", "layers.0.fc1": "layers.*.fc1",
        "layers.1": "layers.*", "layers.1.fc1": "layers.1.fc1"}
    assert unused == ["*.fc2", "nothing.*"]      # '*' does not cross a dot


def test_unknown_style_names_the_registered_ones():
    with pytest.raises(functp.ShardingError, match="unknown parallel style 'colwize'.*'colwise'"):
        functp.match_plan(Net(), {"head": "colwize"})


def _plan_warnings():
    plan = {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise", "head.weight": "colwise",
            "decoder.*": "rowwise"}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        functp.parallelize(Net().double(), _tp_mesh(), plan)
    return [str(x.message) for x in w]


def test_plan_verification_warns_on_rank_0_only(run):
    # processes: warnings.catch_warnings is process-wide, so simulated ranks (threads)
    # could record each other's warnings
    rank0, rank1 = run(2, _plan_warnings, gloo=True)
    assert rank1 == []
    assert len(rank0) == 2
    assert "matched no module" in rank0[0] and "'head.weight'" in rank0[0]
    assert "'decoder.*'" in rank0[0] and "name parameters" in rank0[0]
    assert "no plan rule covers" in rank0[1]
    assert "['head.weight', 'head.bias']" in rank0[1]


def _errors():
    mesh = _tp_mesh()
    msgs = []
    for module, plan in [
        (nn.Linear(H, 3), {"": "colwise"}),                                # 3 rows over 2
        (nn.Embedding(5, H), {"": "embedding_rowwise"}),                   # vocab 5 over 2
        (nn.Linear(H, 6), {"": "packed_colwise"}),                         # 3 per block
        (nn.Embedding(4, H), {"": "rowwise"}),
        (nn.LayerNorm(H), {"": "colwise"}),
    ]:
        with pytest.raises(functp.ShardingError) as e:
            functp.parallelize(module.double(), mesh, plan)
        msgs.append(str(e.value))
    apply, params, _ = functp.parallelize(nn.Linear(H, H).double(), mesh, {"": "colwise"})
    with pytest.raises(functp.ShardingError, match="outside a shard_map"):
        apply(params, torch.ones(1, H, dtype=torch.float64))
    with pytest.raises(functp.ShardingError, match="axis 'model'"):
        functp.parallelize(nn.Linear(H, H), mesh, {}, axis="model")
    return msgs


def _family_errors():
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    with pytest.raises(functp.ShardingError, match="family 'ep' names no axis"):
        functp.parallelize(MLP().double(), mesh, {"ep": {"fc1": "colwise"}})
    with pytest.raises(functp.ShardingError, match="'fc1' is matched by rule 'fc1' of the "
                                                   "'tp' plan and by rule .* of the 'dp'"):
        functp.parallelize(MLP().double(), mesh, {"tp": {"fc1": "colwise"},
                                                  "dp": {"fc*": "colwise"}})
    # two families on two axes: each module's parameters split over its family's axis
    apply, _, specs = functp.parallelize(MLP().double(), mesh, {"tp": {"fc1": "colwise"},
                                                                "dp": {"fc2": "rowwise"}})
    assert specs["fc1.weight"] == P("tp", None) and specs["fc2.weight"] == P(None, "dp")
    assert apply.batch_axes == ()


def test_plan_families_by_mesh_axis(run):
    run(4, _family_errors)


def test_errors_name_the_parameter_shape_style_and_fix(run):
    colwise, vocab, packed, row_emb, norm = run(2, _errors)[0]
    assert "'weight' (shape (3, 8))" in colwise and "'colwise'" in colwise
    assert "multiple of 2" in colwise and "P('tp', None)" in colwise
    assert "(shape (5, 8))" in vocab and "'embedding_rowwise'" in vocab
    assert "packed blocks" in packed and "multiple of 4" in packed
    assert "embedding_rowwise" in row_emb
    assert "2-d `weight`" in norm and "LayerNorm" in norm


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, H)
        self.head = nn.Linear(H, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def _tied(head_style):
    m = _seeded(Tied)
    ids = torch.tensor([[1, 2, 7], [0, 5, 4]])
    try:
        _check(_tp_mesh(), m, {"emb": "embedding_rowwise", "head": head_style}, (ids,),
               (P(),), lambda y: (y.sin() ** 2).sum())
    except functp.ShardingError as e:     # raised on every rank before any communication
        return str(e)


def test_tied_embedding_and_head_share_one_vocab_split(run):
    assert run(2, _tied, "colwise_gather_output") == [None, None]
    msg = run(2, _tied, "rowwise")[0]
    assert "'emb.weight'" in msg and "tied to 'head.weight'" in msg
    assert "P('tp', None)" in msg and "P(None, 'tp')" in msg


def _tied_one_rule(plan, world):
    """A rule for one of the tied modules only: the other gets the style that splits
    the shared weight the same way (before, the embedding took its block of the
    vocabulary for the whole: IndexError deep in the model)."""
    m = _seeded(Tied)
    ids = torch.tensor([[1, 2, 7], [0, 5, 4]])
    _check(_tp_mesh(world), m, plan, (ids,), (P(),), lambda y: (y.sin() ** 2).sum())
    apply, _, specs = functp.parallelize(m, _tp_mesh(world), plan)
    return apply.styles["emb.weight"], specs["emb.weight"]


@pytest.mark.parametrize("world", [2, 4])
def test_tied_weight_with_a_rule_for_one_module(run, world):
    for style, spec in run(world, _tied_one_rule, {"head": "colwise_gather_output"}, world):
        assert spec == P("tp", None) and "'colwise_gather_output'" in style, style
    # and the other way round: a rule for the embedding only
    for style, spec in run(world, _tied_one_rule, {"emb": "embedding_rowwise"}, world):
        assert spec == P("tp", None) and "embedding_rowwise" in style, style



def _kv_heads_on_tp4():
    """2 key/value heads of 4 rows on tp=4: the rows divide (8 over 4) but the heads do
    not; the error says so, naming the module and the fix."""
    from functp.models import LLAMA_TP_PLAN, Llama, LlamaConfig
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=4))
    with pytest.raises(functp.ShardingError) as e:
        functp.parallelize(model, _tp_mesh(4), LLAMA_TP_PLAN)
    return str(e.value)


def test_heads_must_split_whole(run):
    for msg in run(4, _kv_heads_on_tp4):
        assert "layers.0.self_attn.k_proj.weight" in msg and "2 heads of 4" in msg, msg
        assert "'replicated'" in msg and "divides 2" in msg, msg


def test_transformers_style_names_old_and_new_name_the_same_layouts():
    from functp.parallel._style import get_style
    assert get_style("rowwise_rep").input_layout == Replicate()        # split_input
    assert get_style("colwise_rep").output_layout == Replicate()       # gather_output
    for name in ("replicate", "replicated_with_grad_allreduce", "mla_kv_a_proj"):
        assert isinstance(get_style(name), functp.Replicated), (name, get_style(name))


class Stacked(nn.Module):
    """Experts stacked [experts, in, out] (Llama-4's layout), gate and up fused."""
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, H, 2 * F))
        self.down_proj = nn.Parameter(torch.randn(2, F, H))

    def forward(self, x):
        gate, up = (x @ self.gate_up_proj).chunk(2, dim=-1)
        return ((torch.nn.functional.silu(gate) * up) @ self.down_proj).sum(0)


def _parameter_rules():
    rules = functp.ParameterRules({"gate_up_proj": "packed_rowwise", "down_proj": "colwise"},
                                  reduce_output=True)
    _check(_tp_mesh(), _seeded(Stacked), {"": rules}, (randn(B, H, seed=1),), (P(),), _sq)
    with pytest.raises(functp.ShardingError, match="rules for \\['sinks'\\], which are not"):
        functp.parallelize(_seeded(Stacked), _tp_mesh(),
                           {"": functp.ParameterRules({"sinks": "colwise"})})


def test_parameter_rules_lay_out_stacked_experts_one_parameter_at_a_time(run):
    run(2, _parameter_rules)
