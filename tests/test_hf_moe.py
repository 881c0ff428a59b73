"""Every MoE decoder LM of the installed transformers that defines an expert-parallel
plan (``base_model_ep_plan``), as a transformers user would run it with experts on
an ``ep`` mesh axis: ``functp.parallelize(model, mesh, "auto")`` on a tiny float64
configuration (tests/_hf.py's), loss and every parameter's gradient against
the unsharded model, on ep2 and ep2 x tp2 (and dp2 x ep2 for a representative set),
the experts split over ``ep`` and dispatched with ``ragged_all_to_all``. Also
transformers' ``DistributedConfig`` as the description.

``REFUSED``, ``REFUSED_ON``, ``NOT_BUILT`` and ``SLOW`` may only shrink: a type that starts to work
makes its test fail until its entry is removed.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import functp
from functp import P
from _oracle import grads_and_loss

transformers = pytest.importorskip("transformers")
import _hf as hf  # noqa: E402
from _hf import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

EXTRA = {    # beyond _hf's configs: experts in the tiny model
    "zaya": dict(num_experts_per_tok=1),            # its config accepts top-1 only
    "beam": dict(mlp_layer_types=["dense", "sparse"]),
    "flint": dict(mlp_only_layers=[0]),
}

# types that compute a part in float32 (_hf.FLOAT32_INSIDE, and these
# mamba / linear-attention / router parts): their gradients sum over the batch, which
# the ep axis splits, so the float32 rounding shows at ~1e-7 relative
FLOAT32_INSIDE = hf.FLOAT32_INSIDE | {
    "beam", "cohere2_moe", "deepseek_v4", "ernie4_5_moe", "flint", "granitemoehybrid", "jamba", "qwen3_5_moe_text",
    "qwen3_next", "qwen4_exp_text"}

# types whose unsharded model cannot run here (_hf.NOT_BUILT's reasons)
NOT_BUILT = {t: why for t, why in hf.NOT_BUILT.items()}

# types functp refuses with a ShardingError: a substring of the message (the reason)
REFUSED = {
    # its EP plan also splits the dense MLP colwise/rowwise over the expert axis,
    # whose ranks hold different tokens: not a layout functp applies
    "gemma4_text": "cannot apply yet",
}

# refused on one mesh only (the tp axis needs a tensor-parallel plan): a substring
REFUSED_ON = {("zaya", "ep2_tp2"): "no tensor-parallel plan"}

# left out of the 1-d survey to keep this file fast (it runs in test_hf_models.py
# under its TP plan): the reason
SLOW: dict[str, str] = {}     # (nemotron_h left it: a Mamba-2 mixer of test size)



def _types() -> list[str]:
    return [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in CONFIG_MAPPING
            and getattr(CONFIG_MAPPING[t], "base_model_ep_plan", None)]


def _build(model_type: str):
    return hf._build(model_type, **EXTRA.get(model_type, {}))


def _forward(run_model, p, ids):
    return run_model(p, input_ids=ids, use_cache=False).logits


def _reference(model):
    """Seeded token ids and targets, the forward the tests shard, and the unsharded
    model's gradients and loss on them (the oracle)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.VOCAB, (hf.BATCH, hf.SEQ), generator=g)
    tgt = torch.randint(hf.VOCAB, (hf.BATCH, hf.SEQ), generator=g)
    ref_apply, full = functp.functionalize(model)
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: hf._lm_loss(_forward(ref_apply, p, ids), tgt))(full)
    return ids, tgt, _forward, ref_grads, ref_loss


def _survey(model_type: str, shape, names, config=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # transformers' notes about tiny configs
        model = _build(model_type)
    ids, tgt, forward, ref_grads, ref_loss = _reference(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if config is None:
                apply, params, specs = functp.parallelize(
                    model, functp.make_mesh(shape, names), "auto")
            else:
                apply, params, specs = functp.parallelize(model, distributed_config=config)
        mesh, batch = apply.mesh, apply.batch_axes

        def local_loss(p, i, t):
            return functp.pmean(hf._lm_loss(forward(apply, p, i), t), batch)
        step = functp.shard_map(local_loss, mesh, in_specs=(specs, P(batch), P(batch)),
                                out_specs=P())
        with functp.comm_log() as log:
            grads, loss = torch.func.grad_and_value(step)(
                params, *functp.shard((ids, tgt), mesh, P(batch)))
    except functp.ShardingError as e:
        return "refused", str(e)
    experts = {n: specs[n] for n in specs if ".experts." in n}
    return "ran", (hf._max_error(apply.unshard(grads), ref_grads, loss, ref_loss), experts,
                   log.count("ragged_all_to_all"), batch, mesh.axis_names)


_MESHES = {"ep2": ((2,), ("ep",)), "dp2_ep2": ((2, 2), ("dp", "ep")),
           "ep2_tp2": ((2, 2), ("ep", "tp"))}
# every type on ep2 (its experts over ep, its batch split over ep already) and on
# ep2_tp2 (its own tensor-parallel plan beside the experts); a representative set
# (plain, shared-expert, MLA with grouped routing, biased router) also on dp2_ep2:
# a second batch axis over which the experts are replicated is the same code for
# every model (the loss's pmean and the replicated gradients' psum over dp)
DP_EP = {"qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"}
_CASES = [(t, m) for t in _types() for m in _MESHES if m != "dp2_ep2" or t in DP_EP]


def _assert_exact(model_type, outcome, detail, expert_axes):
    if model_type in REFUSED:
        assert outcome == "refused", f"{model_type} now runs: remove it from REFUSED"
        assert REFUSED[model_type] in detail, detail
        return
    assert outcome == "ran", f"{model_type} refused: {detail}"
    (error, where), experts, ragged, _, _ = detail
    tol = 1e-5 if model_type in FLOAT32_INSIDE else 1e-10
    assert error <= tol, f"{model_type}: {where} differs from the unsharded model by {error:.2e}"
    # the experts are split over the expert axes and reached by the ragged dispatch
    assert experts and all(s.dim_axes(0) == expert_axes for s in experts.values()), experts
    assert ragged > 0


@pytest.mark.parametrize("model_type,mesh_name", _CASES, ids=[f"{t}-{m}" for t, m in _CASES])
def test_auto_puts_experts_on_ep_exactly_or_refuses_with_its_reason(run, model_type, mesh_name):
    if model_type in NOT_BUILT:
        pytest.skip(NOT_BUILT[model_type])
    if model_type in SLOW:
        pytest.skip(SLOW[model_type])
    shape, names = _MESHES[mesh_name]
    outcome, detail = run(math.prod(shape), _survey, model_type, shape, names)[0]
    if (model_type, mesh_name) in REFUSED_ON:
        assert outcome == "refused", f"{model_type} now runs on {mesh_name}: remove it from REFUSED_ON"
        assert REFUSED_ON[model_type, mesh_name] in detail, detail
        return
    _assert_exact(model_type, outcome, detail, ("ep",))
    if outcome == "ran":      # tp ranks share a batch; dp and ep ranks hold their own
        assert detail[3] == tuple(a for a in names if a != "tp")


def _config_step(model_type, sizes, tape):
    """One step of ``model_type`` under ``parallelize(model, distributed_config=...)``
    (grad or tape) against the unsharded model, with what transformers fixes: which
    world rank holds which dense and expert shard, the specs, the collectives."""
    from transformers import DistributedConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build(model_type)
        apply, params, specs = functp.parallelize(model,
                                                  distributed_config=DistributedConfig(**sizes))
    ids, tgt, forward, ref_grads, ref_loss = _reference(model)
    mesh, batch = apply.mesh, apply.batch_axes
    step = functp.shard_map(lambda p, i, t: functp.pmean(hf._lm_loss(forward(apply, p, i), t),
                                                         batch),
                            mesh, in_specs=(specs, P(batch), P(batch)), out_specs=P())
    local = functp.shard((ids, tgt), mesh, P(batch))
    with functp.comm_log() as log:
        grads, loss = grads_and_loss(step, params, *local, tape=tape)
    # each rank's place in transformers' two row-major meshes, (dp_replicate, fsdp,
    # tp) and (dp_replicate, efsdp, ep), against its index on functp's axes
    where = functp.shard_map(lambda: tuple(functp.axis_index(a) for a in (
        ("efsdp", "ep"), "tp", "efsdp", ("ep", "tp"))), mesh, in_specs=(), out_specs=P())()
    from _fsdp import _groups
    dense = {n: P() if ".experts." in n else s for n, s in specs.items()}
    groups = _groups(model, dense, model.fsdp_plan, axis="efsdp")
    return (hf._max_error(apply.unshard(grads), ref_grads, loss, ref_loss), dict(specs),
            batch, mesh.axis_names, dict(mesh.shape), log.summary(), where,
            len(set(groups.values())))


_CONFIGS = {"ep2_fsdp4": dict(ep_size=2, fsdp_size=4),                 # efsdp 2
            "tp2_ep2_fsdp2": dict(tp_size=2, ep_size=2, fsdp_size=2),   # efsdp 2, ep == tp
            "tp2_ep4_fsdp2": dict(tp_size=2, ep_size=4, fsdp_size=2),   # efsdp 1
            "ep2_fsdp2_replicate2": dict(ep_size=2, fsdp_size=2, dp_replicate_size=2),
            "tp2_ep2_fsdp2_replicate2": dict(tp_size=2, ep_size=2, fsdp_size=2,
                                             dp_replicate_size=2)}
_CONFIG_CASES = [("qwen3_moe", "ep2_fsdp4", False), ("qwen3_moe", "ep2_fsdp4", True),
                 ("mixtral", "tp2_ep2_fsdp2", False), ("mixtral", "tp2_ep2_fsdp2", True),
                 ("qwen3_moe", "tp2_ep4_fsdp2", False), ("mixtral", "ep2_fsdp2_replicate2", True),
                 ("qwen3_moe", "tp2_ep2_fsdp2_replicate2", False)]


@pytest.mark.parametrize("model_type,config,tape", _CONFIG_CASES,
                         ids=[f"{t}-{c}-{'tape' if b else 'grad'}" for t, c, b in _CONFIG_CASES])
def test_a_config_with_ep_and_fsdp_shards_dense_over_fsdp_and_experts_over_ep_and_efsdp(
        run, model_type, config, tape):
    pytest.importorskip("transformers")
    sizes = _CONFIGS[config]
    r, f, t, e = (sizes.get(k, 1) for k in ("dp_replicate_size", "fsdp_size", "tp_size",
                                             "ep_size"))
    efsdp, world = f * t // e, r * f * t
    results = run(world, _config_step, model_type, sizes, tape)
    (error, at), specs, batch, names, shape, log, _, groups = results[0]
    assert error <= 1e-10, f"{model_type} {config}: {at} differs by {error:.2e}"
    assert names == ("dp_replicate", "efsdp", "ep", "tp")
    assert shape == {"dp_replicate": r, "efsdp": efsdp, "ep": e // t, "tp": t}
    # the same world ranks hold the same shards as in transformers' meshes
    for rank, (_, _, _, _, _, _, where, _) in enumerate(results):
        assert where == ((rank // t) % f, rank % t, (rank // e) % efsdp, rank % e), (rank, where)
    # the experts: ep_size shards, each FSDP-sharded over efsdp on the expert dimension
    experts = {n: s for n, s in specs.items() if ".experts." in n}
    ep_axes = ("ep", "tp") if t > 1 else ("ep",)
    want = ep_axes + (("efsdp",) if efsdp > 1 else ())
    assert experts and all(s.dim_axes(0) == want for s in experts.values()), experts
    # every dense parameter the tp plan leaves is FSDP-sharded over transformers'
    # fsdp axis, ("efsdp", "ep"), or left whole when no dimension divides
    dense = {n: s for n, s in specs.items() if n not in experts}
    fsdp = [n for n, s in dense.items() if ("efsdp", "ep") in s]
    assert fsdp and all(("tp" in s.axes) != (n in fsdp) or not s.axes
                        for n, s in dense.items()), dense
    # one gather and one reduce-scatter per group (the model's fsdp_plan units: each
    # layer, the embedding, the final norm with the LM head) and layer call; under tape the
    # layers the model's fsdp_plan frees (free_full_weight) gather the weights their
    # backward reads once more, one by one (torch.func keeps them)
    gathers = log[("all_gather", ("efsdp", "ep"))]
    assert 1 < groups < len(fsdp)
    assert gathers == groups if not tape else groups < gathers <= groups + len(fsdp)
    assert log[("reduce_scatter", ("efsdp", "ep"))] == groups
    if efsdp > 1:       # each layer's experts in one flat buffer
        layers = {n.split(".experts.")[0] for n in experts}
        assert log[("all_gather", ("efsdp",))] == len(layers)
        assert log[("reduce_scatter", ("efsdp",))] == len(layers)
    else:
        assert ("all_gather", ("efsdp",)) not in log
    if r > 1:       # HSDP: the shards' gradients all-reduced over the replicas
        assert log[("all_reduce", ("dp_replicate",))] >= 1
    assert batch == (("dp_replicate", "efsdp", "ep") if t > 1
                     else ("dp_replicate", "efsdp", "ep", "tp"))


@pytest.mark.parametrize("fields", [dict(tp_size=2, ep_size=2, tp_plan={}),
                                    dict(tp_size=2, enable_expert_parallel=True)],
                         ids=["tp_plan_empty", "enable_expert_parallel"])
def test_tp_ranks_without_a_tp_plan_still_share_one_batch_for_the_experts(run, fields):
    # transformers' tp ranks hold one batch whether or not a tp plan splits the dense
    # modules: the experts' dispatch slices it, so 'tp' is no batch axis (it was, and
    # the loss was off by 99%)
    from transformers import DistributedConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # enable_expert_parallel is deprecated
        config = DistributedConfig(**fields)
    outcome, detail = run(2, _survey, "qwen3_moe", None, None, config)[0]
    _assert_exact("qwen3_moe", outcome, detail, ("ep", "tp"))
    assert detail[3] == ("dp_replicate", "efsdp", "ep")


def _bad_config(fields, match):
    model = _build("qwen3_moe")
    with pytest.raises(functp.ShardingError, match=match):
        functp.parallelize(model, distributed_config=fields)


def test_a_config_functp_cannot_apply_is_refused():
    _bad_config(dict(tp_size=2, pp_size=2), "pp_size=2")
    _bad_config(dict(tp_size=2, ep_size=3), "multiple of tp_size")
    _bad_config(dict(tp_size=4), "multiply to the world size")
    _bad_config(dict(tp_sise=2), "unknown fields")
    _bad_config(dict(ep_size=2, ep_plan="auto"), "ep_plan must be a dict of rules or None")


def _experts_do_not_split():
    # 4 experts over ep_size 2 x efsdp_size 4 shards (fsdp 4 x tp 2 / ep 2)
    _bad_config(dict(tp_size=2, ep_size=2, fsdp_size=4),
                r"4 experts, which do not split into ep_size x efsdp_size = 2 x 4 = 8 "
                r"shards.*ep_size = fsdp_size x tp_size makes efsdp_size 1")


def test_experts_that_do_not_split_over_ep_and_efsdp_are_refused_on_every_rank(run):
    run(8, _experts_do_not_split)


def _dense_on_ep():
    model = hf._build("llama")
    with pytest.raises(functp.ShardingError, match="no expert-parallel plan"):
        functp.parallelize(model, functp.make_mesh((2,), ("ep",)), "auto")


def test_a_dense_model_on_an_ep_mesh_is_refused(run):
    run(2, _dense_on_ep)


def test_every_listed_type_exists():
    known = set(_types())
    for table in (REFUSED, SLOW, EXTRA, DP_EP, dict.fromkeys(t for t, _ in REFUSED_ON),
                  FLOAT32_INSIDE - hf.FLOAT32_INSIDE):
        assert set(table) <= known, set(table) - known


def _verify(config):
    model = _build("mixtral")
    if config is None:
        return functp.verify_plan(model, functp.make_mesh((2, 2), ("ep", "tp")), "auto")
    from transformers import DistributedConfig
    return functp.verify_plan(model, None, "auto",
                              distributed_config=DistributedConfig(**config))


@pytest.mark.parametrize("config", [None, dict(tp_size=2, ep_size=4, fsdp_size=2),
                                    dict(ep_size=2, fsdp_size=4)],
                         ids=["ep2_tp2", "config_tp2_ep4", "config_ep2_fsdp4_efsdp2"])
def test_verify_plan_checks_an_expert_parallel_plan(run, config):
    # modules inside the experts run on the pairs a rank received: not compared one
    # by one; the experts' combined output and every gradient are
    report = run(4, _verify, config)[0]
    assert report["max_error"] < 1e-5 and report["parameters"] > 0
