"""Expert parallelism with the ragged dispatch (``functp.ExpertDispatch``) against the
unsharded float64 MoE: loss and every gradient through ``torch.func.grad`` and tape
autograd, on dp x ep and ep x tp meshes (2 x 2) and on 4 and 8 ranks (1-d); a
capacity factor's drops against a reference that drops by hand; the bytes the
dispatch sends equal the routed pairs' bytes, where the padded dispatch sends the
worst case; routes to no expert are an error on every rank. The block and its
unsharded oracle: ``_moe.py``."""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P
from _moe import H, K, S, _batch, _block, _reference
from _oracle import assert_tree_close


def _plan(mesh, dispatch) -> dict:
    dense = ({"up": "colwise", "down": "rowwise", "moe.router": "replicated"}
             if "tp" in mesh.axis_names else
             {"up": "replicated", "down": "replicated", "moe.router": "replicated"})
    if "tp" not in mesh.axis_names:
        return {"ep": {**dense, "moe.experts": dispatch}}
    return {"tp": dense, "ep": {"moe.experts": dispatch}}


def _drop_by_hand(weights, idx, chunks: int, experts: int, cf: float, policy: str):
    """The routing weights with the pairs an expert over capacity drops set to zero:
    each chunk of tokens (one rank's) fills each expert up to its capacity, by
    weight or by position, in a plain loop."""
    w = weights.reshape(-1, K).clone()
    e = idx.reshape(-1, K)
    per = w.shape[0] // chunks
    for c in range(chunks):
        cap = math.ceil(per * K / experts * cf)
        for ex in range(experts):
            pairs = [(t, j) for t in range(c * per, (c + 1) * per) for j in range(K)
                     if e[t, j] == ex]
            if policy == "probs":
                pairs.sort(key=lambda p: -w[p].item())
            for t, j in pairs[cap:]:
                w[t, j] = 0
    return w.reshape(weights.shape)


def _program(shape, names, experts, dispatch, drop=None, route=None, rows=2, seq=S):
    mesh = functp.make_mesh(shape, names)
    module = _block(experts)
    if route is not None:          # the same routing change for both runs
        module.moe.router.register_forward_hook(lambda m, a, out: route(*out))
    apply, params, specs = functp.parallelize(module, mesh, _plan(mesh, dispatch))
    batch = apply.batch_axes
    x = _batch(rows * mesh.axis_size(batch), seq)
    ref_grads, ref_loss = _reference(module, x, drop)

    def body(p, xb):
        return functp.pmean((apply(p, xb) ** 2).mean(), batch)
    step = functp.shard_map(body, mesh, in_specs=(specs, P(batch)), out_specs=P())
    xl = functp.shard(x, mesh, P(batch))
    with functp.comm_log() as log:
        grads, loss = torch.func.grad_and_value(step)(params, xl)
    assert_tree_close(loss, ref_loss, "loss (torch.func)")
    assert_tree_close(apply.unshard(grads), ref_grads, "grad (torch.func)")
    tape = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    loss2 = step(tape, xl)
    got = torch.autograd.grad(loss2, list(tape.values()))
    assert_tree_close(loss2.detach(), ref_loss, "loss (tape)")
    assert_tree_close(apply.unshard(dict(zip(tape, got))), ref_grads, "grad (tape)")
    return log, dict(dispatch.dropped)


MESHES = {"dp2_ep2": ((2, 2), ("dp", "ep")), "ep2_tp2": ((2, 2), ("ep", "tp")),
          "ep4": ((4,), ("ep",)), "ep8": ((8,), ("ep",))}


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_ragged_dispatch_equals_the_unsharded_moe(run, mesh_name):
    shape, names = MESHES[mesh_name]
    log, dropped = run(math.prod(shape), _program, shape, names, 8,
                       functp.ExpertDispatch())[0]
    assert dropped == {"moe.experts": 0}
    assert log.count("ragged_all_to_all") == 4 and log.count("all_to_all") == 0


def test_tensor_parallel_ranks_dispatch_their_slice_of_the_shared_tokens(run):
    # ep x tp: each tp rank sends half the tokens it shares with its tp peer, and the
    # outputs are gathered back over tp
    log, _ = run(4, _program, (2, 2), ("ep", "tp"), 4,
                 functp.ExpertDispatch(shared=("tp",)))[0]
    assert log.count("ragged_all_to_all", ("ep",)) == 4
    assert log.count("all_gather", ("tp",)) >= 1


@pytest.mark.parametrize("shape,names,replicate", [
    ((2, 2), ("efsdp", "ep"), ()),
    ((2, 2, 2), ("dp_replicate", "efsdp", "ep"), ("dp_replicate",))],
    ids=["efsdp2_ep2", "replicate2_efsdp2_ep2"])
def test_experts_fsdp_sharded_over_efsdp_are_gathered_per_call(run, shape, names, replicate):
    # each rank stores a slice of its experts (dim 0 over ('ep', 'efsdp')), gathers
    # them over efsdp in the dispatch's pre-hook; the gradient comes back
    # reduce-scattered (and, over the replicas, all-reduced on the slice)
    dispatch = functp.ExpertDispatch(fsdp="efsdp", replicate=replicate)
    log, _ = run(math.prod(shape), _program, shape, names, 8, dispatch)[0]
    # gate_up_proj and down_proj in one flat buffer: one gather, one reduce-scatter
    assert log.count("all_gather", ("efsdp",)) == 1
    assert log.count("reduce_scatter", ("efsdp",)) == 1
    if replicate:
        assert log.count("all_reduce", ("dp_replicate",)) >= 1
    assert log.count("ragged_all_to_all", ("ep",)) == 4


@pytest.mark.parametrize("tp,seq,pad", [(2, 3, False), (4, 5, False), (4, 3, False),
                                        (4, 5, True)])
def test_shared_tokens_that_do_not_divide_over_tp_are_split_unevenly(run, tp, seq, pad):
    # seq tokens a batch rank over tp ranks: torch.chunk's blocks (3 over 2: 2 + 1;
    # 5 over 4: 2 + 2 + 1 + 0; 3 over 4: 1 + 1 + 1 + 0), the gather padded and cut;
    # padded to capacity, each peer's capacity is its own (0 for an empty slice)
    extra = dict(capacity_factor=4.0, pad_to_capacity=True) if pad else {}   # (no drops)
    log, _ = run(2 * tp, _program, (2, tp), ("ep", "tp"), 8,
                 functp.ExpertDispatch(shared=("tp",), **extra), None, None, 1, seq)[0]
    assert log.count("ragged_all_to_all", ("ep",)) == 4
    assert log.count("all_gather", ("tp",)) >= 1


def _to_rank_0(weights, idx):
    return weights, idx % 2            # experts 0 and 1: rank 0's of 4 experts on 2 ranks


def test_a_rank_that_receives_no_tokens_still_runs_every_collective(run):
    # rank 1's experts get nothing: their output stays connected, so rank 1's backward
    # runs the same exchanges as rank 0's, and its experts' gradients are zero
    log, _ = run(2, _program, (2,), ("ep",), 4, functp.ExpertDispatch(), None,
                 _to_rank_0)[1]
    assert log.count("ragged_all_to_all") == 4


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_factor_drops_what_megatron_drops(run, policy):
    cf, experts = 0.5, 4

    def drop(weights, idx):         # 4 ranks' tokens, each rank's chunk on its own
        return _drop_by_hand(weights, idx, 4, experts, cf, policy)
    _, dropped = run(4, _program, (2, 2), ("dp", "ep"), experts,
                     functp.ExpertDispatch(capacity_factor=cf, drop_policy=policy),
                     drop)[0]
    assert dropped["moe.experts"] > 0          # a factor of 0.5 must drop something


@pytest.mark.parametrize("cf", [0.5, 1.0, 2.0])
def test_pad_to_capacity_drops_what_megatron_drops_and_pads_the_rest(run, cf):
    # the same pairs dropped as without padding; the padding rows change nothing
    experts = 4

    def drop(weights, idx):
        return _drop_by_hand(weights, idx, 4, experts, cf, "probs")
    dispatch = functp.ExpertDispatch(capacity_factor=cf, pad_to_capacity=True)
    log, dropped = run(4, _program, (2, 2), ("dp", "ep"), experts, dispatch, drop)[0]
    # top-2 of 4 experts: an expert gets at most half of the pairs, so 2.0 drops none
    if cf != 1.0:
        assert (dropped["moe.experts"] > 0) == (cf < 1), dropped
    assert log.count("ragged_all_to_all") == 4


def _bytes(dispatch):
    mesh = functp.make_mesh((4,), ("ep",))
    module = _block(8)
    apply, params, specs = functp.parallelize(module, mesh, _plan(mesh, dispatch))
    x = _batch(8)
    with torch.no_grad():            # every rank's routing, from the unsharded router
        h = x + module.down(torch.tanh(module.up(x)))
        _, idx = module.moe.router(h)
    owner = (idx // 2).reshape(4, -1)             # [source rank, pair]: 2 experts a rank
    me = functp.process_index()
    sent, received = owner[me].numel(), int((owner == me).sum())
    step = functp.shard_map(lambda p, xb: functp.pmean((apply(p, xb) ** 2).mean(), "ep"),
                            mesh, in_specs=(specs, P("ep")), out_specs=P())
    with functp.comm_log() as log:
        torch.func.grad(step)(params, functp.shard(x, mesh, P("ep")))
    return log, sent, received


def test_comm_log_counts_exactly_the_routed_pairs(run):
    row = H * 8                                   # float64 rows of H
    for log, sent, received in run(4, _bytes, functp.ExpertDispatch()):
        # forward: the pairs out, their results back; backward: the same, reversed
        assert log.nbytes("ragged_all_to_all") == 2 * (sent + received) * row, (
            log.summary(), sent, received)
        assert log.count("ragged_all_to_all") == 4, log.summary()
    for log, sent, _ in run(4, _bytes, functp.ExpertDispatch(dispatch="padded")):
        # the padded blocks: every block holds all of a rank's pairs (4 blocks of
        # `sent` rows), forward and back, plus the expert ids (int64, forward)
        assert log.nbytes("all_to_all") == 4 * (4 * sent * row) + 4 * sent * 8, (
            log.summary(), sent)


def _padded_bytes(cf):
    dispatch = functp.ExpertDispatch(capacity_factor=cf, pad_to_capacity=True)
    log, sent, _ = _bytes(dispatch)
    return log, sent, dict(dispatch.dropped)


@pytest.mark.parametrize("cf", [0.5, 1.5])
def test_pad_to_capacity_sends_capacity_rows_to_every_peer(run, cf):
    # 4 ranks, 8 experts (2 a rank); each rank's 6 tokens x top-2 = 12 pairs:
    # capacity ceil(12 / 8 * cf) rows per expert, 2 x capacity rows to each peer,
    # whatever the routing: 4 exchanges (out, back, and both in the backward), and a
    # flag row to each peer out (and in its backward); no exchange of counts
    for log, sent, dropped in run(4, _padded_bytes, cf):
        cap = math.ceil(sent / 8 * cf)
        per_peer = 2 * cap * H * 8                  # local experts x capacity x hidden x 8 B
        assert log.nbytes("ragged_all_to_all") == 4 * 4 * per_peer + 2 * 4 * H * 8, (
            log.summary(), sent, cap)
        assert log.count("ragged_all_to_all") == 4, log.summary()
        assert log.count("all_gather") == 0, log.summary()


def _bad_route(extra):
    mesh = functp.make_mesh((2,), ("ep",))
    module = _block(4)
    apply, params, specs = functp.parallelize(module, mesh,
                                              _plan(mesh, functp.ExpertDispatch(**extra)))
    me = functp.process_index()

    def router_hook(m, a, out):     # rank 1 names expert 4 of 0..3
        return out if me == 0 else (out[0], out[1].clamp(max=3).index_fill(0, torch.tensor([0]), 4))
    module.moe.router.register_forward_hook(router_hook)
    step = functp.shard_map(lambda p, xb: functp.pmean((apply(p, xb) ** 2).mean(), "ep"),
                            mesh, in_specs=(specs, P("ep")), out_specs=P())
    with pytest.raises(functp.ShardingError, match=r"outside 0\.\.3.*ranks \[1\]"):
        step(params, functp.shard(_batch(4), mesh, P("ep")))


@pytest.mark.parametrize("extra", [{}, dict(capacity_factor=1.0, pad_to_capacity=True)],
                         ids=["ragged", "pad_to_capacity"])
def test_a_route_to_no_expert_is_an_error_on_every_rank(run, extra):
    # padded to capacity no counts are exchanged: the flag rows tell every rank
    run(2, _bad_route, extra)


def test_bad_options_are_refused():
    with pytest.raises(functp.ShardingError, match="capacity_factor"):
        functp.ExpertDispatch(capacity_factor=0)
    with pytest.raises(functp.ShardingError, match="drop_policy"):
        functp.ExpertDispatch(drop_policy="random")
    with pytest.raises(functp.ShardingError, match="never drops"):
        functp.ExpertDispatch(dispatch="padded", capacity_factor=1.0)
    with pytest.raises(functp.ShardingError, match="needs a capacity_factor"):
        functp.ExpertDispatch(pad_to_capacity=True)
    with pytest.raises(functp.ShardingError, match="give fsdp= too"):
        functp.ExpertDispatch(replicate=("dp_replicate",))
    # one axis by its name, as fsdp= takes it (not its letters as axes)
    assert functp.ExpertDispatch(fsdp="efsdp", replicate="dp_replicate").replicate == \
        ("dp_replicate",) == functp.FullyShard(2, "dp_replicate").replicate
