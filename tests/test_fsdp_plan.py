"""The FSDP / HSDP plan family of ``parallelize``: every parameter no other family
splits is stored as its block over ``fsdp`` and gathered where its module runs.

Checked against the unsharded float64 model (loss and every gradient), through
``torch.func.grad`` and tape autograd, with the collectives each step issues."""
from __future__ import annotations

import warnings

import pytest
import torch

import functp
from functp import P
from functp.models import LLAMA_TP_PLAN, Llama, LlamaConfig
from _fsdp import _MESHES, _groups, _loss, _max_error, _step

def _llama_case(mesh_name, tape):
    shape, names = _MESHES[mesh_name]
    torch.manual_seed(0)
    model = Llama(LlamaConfig()).double()
    plan = {"fsdp": "auto", **({"tp": LLAMA_TP_PLAN} if "tp" in names else {})}
    (loss, grads, fwd, log, specs, apply, local), (ref_loss, ref_grads) = _step(
        model, functp.make_mesh(shape, names), plan, tape, lambda a, p, i: a(p, i))
    sharded = [n for n, s in specs.items() if "fsdp" in s.axes]
    block_bytes = sum(local[n].numel() * 8 for n in sharded)
    return (abs(loss.item() - ref_loss.item()), _max_error(grads, ref_grads), sharded,
            fwd.summary(), log.summary(), log.nbytes("all_reduce", ("dp_replicate",)),
            block_bytes, apply.batch_axes, dict(apply.styles),
            len(set(_groups(model, specs).values())))


@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
@pytest.mark.parametrize("mesh_name", list(_MESHES))
def test_fsdp_family_is_exact_and_gathers_each_group_once(run, mesh_name, tape):
    shape, names = _MESHES[mesh_name]
    world = shape[0] * (shape[1] if len(shape) > 1 else 1)
    (loss_err, grad_err, sharded, fwd, log, replicate_bytes, block_bytes, batch,
     styles, groups) = run(world, _llama_case, mesh_name, tape)[0]
    assert loss_err < 1e-12 and grad_err < 1e-10, (loss_err, grad_err)
    n = len(sharded)
    if "tp" in names:      # the tensor-parallel plan keeps its splits; the norms go to FSDP
        assert n == 5 and all("norm" in k for k in sharded), sharded
        assert "fsdp" not in "".join(v for k, v in styles.items() if "proj" in k)
    else:                  # every parameter of the tiny Llama divides
        assert n == len(styles), sharded
    # one gather per group (a layer, the rest: float64 only) in the forward, one
    # reduce-scatter per group in the backward (nothing else over 'fsdp' but the loss's
    # pmean and the tp-split parameters' bucketed all-reduce)
    assert 1 < groups < n
    assert fwd.get(("all_gather", ("fsdp",))) == groups
    assert ("reduce_scatter", ("fsdp",)) not in fwd
    assert log[("all_gather", ("fsdp",))] == groups == log[("reduce_scatter", ("fsdp",))]
    assert batch == tuple(a for a in names if a != "tp")
    if "dp_replicate" in names:     # HSDP: the blocks' gradients all-reduced over replicas
        assert log[("all_reduce", ("dp_replicate",))] >= 1
        assert replicate_bytes == block_bytes
    else:
        assert ("all_reduce", ("dp_replicate",)) not in log


def _hf_case(config):
    import _hf as hf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf._build("llama")
    forward = lambda a, p, i: a(p, input_ids=i, use_cache=False).logits
    (loss, grads, fwd, log, specs, apply, _), (ref_loss, ref_grads) = _step(
        model, None, "auto", False, forward, distributed_config=config)
    sharded = [n for n, s in specs.items() if "fsdp" in s.axes]
    plan = {**model.fsdp_plan, **((config or {}).get("fsdp_plan") or {})}
    return (hf._max_error(grads, ref_grads, loss, ref_loss), apply.mesh.axis_names,
            len(sharded), len(specs), log.summary(), apply.batch_axes,
            len(set(_groups(model, specs, plan).values())))


@pytest.mark.parametrize("config", [dict(fsdp_size=2, dp_replicate_size=2,
                                         fsdp_plan={"lm_head": "keep_full_weight"}),
                                    dict(fsdp_size=2, tp_size=2)],
                         ids=["replicate2_fsdp2", "fsdp2_tp2"])
def test_a_transformers_config_with_fsdp_size_shards_over_fsdp(run, config):
    pytest.importorskip("transformers")
    (err, where), axes, n, total, log, batch, groups = run(4, _hf_case, config)[0]
    assert err < 1e-10, f"{where} differs by {err:.2e}"
    assert axes == ("dp_replicate", "fsdp", "tp")          # transformers' axis names
    # the batch over both data axes (and the size-1 'tp' axis without tensor parallelism)
    assert batch == (("dp_replicate", "fsdp") if config.get("tp_size", 1) > 1
                     else ("dp_replicate", "fsdp", "tp"))
    # one gather and one reduce-scatter per group (the model's fsdp_plan units: the
    # layers, the embedding, the final norm and the LM head together, as transformers
    # wraps that kept pair in one fully_shard)
    assert 1 < groups < n
    assert log[("all_gather", ("fsdp",))] == groups == log[("reduce_scatter", ("fsdp",))]
    if config.get("tp_size", 1) > 1:
        assert 0 < n < total          # the tp plan's splits stay; the rest is FSDP
    else:
        assert n == total


def _indivisible():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                torch.nn.Linear(3, 4)).double()
    mesh = functp.make_mesh((2,), ("fsdp",))
    apply, params, specs = functp.parallelize(model, mesh, {"fsdp": "auto"})
    x = torch.randn(6, 4, dtype=torch.float64)
    step = functp.shard_map(lambda p, x: functp.pmean(apply(p, x).square().mean(), "fsdp"),
                            mesh, in_specs=(specs, P("fsdp")), out_specs=P())
    grads = apply.unshard(torch.func.grad(step)(params, functp.shard(x, mesh, P("fsdp"))))
    ref_apply, full = functp.functionalize(model)
    ref = torch.func.grad(lambda p: ref_apply(p, x).square().mean())(full)
    return specs, dict(apply.fsdp_replicated), _max_error(grads, ref)


def test_a_parameter_no_dimension_of_which_divides_stays_replicated_with_its_reason(run):
    specs, why, err = run(2, _indivisible)[0]
    # [3, 4]: dim 0 does not divide, dim 1 does; [4, 3]: dim 0
    assert specs["0.weight"] == P(None, "fsdp") and specs["2.weight"] == P("fsdp")
    assert specs["0.bias"] == P() and specs["2.bias"] == P("fsdp")
    assert set(why) == {"0.bias"} and "(3,)" in why["0.bias"] and "2 fsdp shards" in why["0.bias"]
    assert err < 1e-12


def _bad(world_mesh, plan, match, config=None):
    model = Llama(LlamaConfig()).double()
    with pytest.raises(functp.ShardingError, match=match):
        functp.parallelize(model, world_mesh, plan, distributed_config=config)


def _bad_inputs():
    _bad(None, "auto", "multiply to the world size", dict(fsdp_size=3))
    _bad(None, "auto", "fsdp_size must be an int", dict(fsdp_size=0))
    _bad(None, "auto", "fsdp_plan rules {'lm_head': 'keep_weights'}",
         dict(fsdp_size=4, fsdp_plan={"lm_head": "keep_weights", "norm": "free_full_weight"}))
    mesh = functp.make_mesh((2, 2), ("fsdp", "tp"))
    _bad(mesh, {"tp": "auto"}, "'auto' is the FSDP family's value")
    _bad(functp.make_mesh((4,), ("dp",)), {"fsdp": "auto"}, "names no axis")


def test_bad_fsdp_inputs_raise_clearly_on_every_rank(run):
    run(4, _bad_inputs)


def _tied_gpt2():
    from functp.models import GPT2, GPT2Config
    torch.manual_seed(0)
    model = GPT2(GPT2Config()).double()
    (loss, grads, fwd, log, specs, apply, _), (ref_loss, ref_grads) = _step(
        model, functp.make_mesh((2,), ("fsdp",)), {"fsdp": "auto"}, True,
        lambda a, p, i: a(p, i % 16))
    groups = _groups(model, specs)
    return _max_error(grads, ref_grads), log.summary(), len(set(groups.values())), groups


def test_a_tied_weight_is_gathered_by_each_module_that_uses_it(run):
    err, log, n, groups = run(2, _tied_gpt2)[0]
    assert err < 1e-10
    # the embedding and the LM head share one block, both in the root's group: its
    # flat buffer holds the block twice, and the two gradients add up in the block's
    assert groups["wte"] == groups["lm_head"] == ""
    assert log[("all_gather", ("fsdp",))] == n == log[("reduce_scatter", ("fsdp",))]


def _verify_and_auto():
    import _hf as hf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf._build("llama")
        report = functp.verify_plan(model, None, "auto",
                                    distributed_config=dict(fsdp_size=2, dp_replicate_size=2))
        # "auto" on a mesh with an 'fsdp' axis: the tp plan, and FSDP for the rest
        apply, _, specs = functp.parallelize(model, functp.make_mesh((2, 2), ("fsdp", "tp")))
    return report, {s for s in apply.styles.values()}, apply.batch_axes


def test_verify_plan_and_auto_see_the_fsdp_family(run):
    pytest.importorskip("transformers")
    report, styles, batch = run(4, _verify_and_auto)[0]
    assert report["max_error"] < 1e-10 and report["parameters"] > 0
    assert any("FullyShard" in s for s in styles) and any("colwise" in s for s in styles)
    assert batch == ("fsdp",)


def _with_experts():
    import _moe
    mesh = functp.make_mesh((2, 2), ("fsdp", "ep"))
    module = _moe._block(4)
    apply, params, specs = functp.parallelize(
        module, mesh, {"ep": {"moe.experts": functp.ExpertDispatch()}, "fsdp": "auto"})
    batch = apply.batch_axes
    x = _moe._batch(2 * mesh.axis_size(batch))
    ref_grads, ref_loss = _moe._reference(module, x, None)
    step = functp.shard_map(lambda p, xb: functp.pmean((apply(p, xb) ** 2).mean(), batch),
                            mesh, in_specs=(specs, P(batch)), out_specs=P())
    with functp.comm_log() as log:
        grads, loss = torch.func.grad_and_value(step)(params, functp.shard(x, mesh, P(batch)))
    sharded = [n for n, s in specs.items() if "fsdp" in s.axes]
    return (abs(loss.item() - ref_loss.item()), _max_error(apply.unshard(grads), ref_grads),
            {n: specs[n] for n in specs if "experts" in n}, sharded, log.summary(), batch,
            len(set(_groups(module, specs).values())))


def test_fsdp_composes_with_an_expert_parallel_family(run):
    loss_err, err, experts, sharded, log, batch, groups = run(4, _with_experts)[0]
    assert loss_err < 1e-12 and err < 1e-10, (loss_err, err)
    assert experts and all(s.dim_axes(0) == ("ep",) for s in experts.values()), experts
    assert sharded and not any("experts" in n for n in sharded)
    assert log[("all_gather", ("fsdp",))] == groups == log[("reduce_scatter", ("fsdp",))]
    assert batch == ("fsdp", "ep")
