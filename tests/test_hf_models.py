"""Every decoder LM of the installed transformers that defines a tensor-parallel plan,
as a new user would run it: ``functp.parallelize(model, mesh, "auto")`` on a tiny
float64 configuration, loss and every parameter's gradient against the unsharded
model. Each model type either matches or raises a ``ShardingError`` whose reason is
listed in ``REFUSED`` below; nothing runs silently wrong and nothing crashes.

``REFUSED`` and ``NOT_BUILT`` may only shrink: a type that starts to work makes its
test fail until its entry is removed, so the list always says what functp does.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import functp
from functp import P

pytest.importorskip("transformers")
from _hf import (EXTRA, FLOAT32_INSIDE, NOT_BUILT, SEQ, VOCAB, _build, _survey,  # noqa: E402
                 _types)

# types functp refuses with a ShardingError: a substring of the message (the reason)
REFUSED: dict[str, str] = {}

# a representative set also runs on a 2 x 2 (dp, tp) mesh
TWO_D = {"llama", "qwen3_moe", "gemma3n_text", "deepseek_v2", "granite_swa", "llama4_text",
         "doge"}

_CASES = [(t, "tp2") for t in _types()] + [(t, "dp2_tp2") for t in _types() if t in TWO_D]
_MESHES = {"tp2": ((2,), ("tp",)), "dp2_tp2": ((2, 2), ("dp", "tp"))}


@pytest.mark.parametrize("model_type,mesh_name", _CASES, ids=[f"{t}-{m}" for t, m in _CASES])
def test_auto_plan_is_exact_or_refused_with_its_reason(run, model_type, mesh_name):
    if model_type in NOT_BUILT:
        pytest.skip(NOT_BUILT[model_type])
    shape, names = _MESHES[mesh_name]
    outcome, detail = run(len(names) * 2 if len(names) == 2 else 2, _survey, model_type,
                          shape, names)[0]
    if model_type in REFUSED:
        assert outcome == "refused", (
            f"{model_type} now runs under 'auto' (worst error {detail}): remove it from "
            f"REFUSED if that is exact")
        assert REFUSED[model_type] in detail, detail
        return
    assert outcome == "ran", f"{model_type} refused: {detail}"
    error, where = detail
    tol = 1e-5 if model_type in FLOAT32_INSIDE else 1e-10
    assert error <= tol, f"{model_type}: {where} differs from the unsharded model by {error:.2e}"


def test_every_listed_type_exists():
    # a stale entry would hide nothing, but would make the lists lie
    known = set(_types())
    for table in (REFUSED, NOT_BUILT, EXTRA, TWO_D, FLOAT32_INSIDE):
        assert set(table) <= known, set(table) - known


def _verify_gemma3n():
    from functp.parallel._hf import _auto_plan
    model = _build("gemma3n_text")
    mesh = functp.make_mesh((2,), ("tp",))
    # transformers' own plan, without the rules 'auto' adds so that the activation
    # sparsity's mean and deviation are over the whole intermediate dimension
    plan = {k: v for k, v in _auto_plan(model).items()
            if not k.endswith(("0.mlp.gate_proj", "0.mlp.act_fn"))}
    with pytest.raises(functp.ShardingError) as e:
        functp.verify_plan(model, mesh, plan)
    report = functp.verify_plan(model, mesh, "auto")
    apply, _, _ = functp.parallelize(model, mesh, "auto", verify=True)
    return str(e.value), report, apply.split_share, repr(apply)


def test_verify_plan_names_the_module_fed_by_a_reduction_over_a_split_dimension(run):
    message, report, share, text = run(2, _verify_gemma3n)[0]
    assert "first module whose output differs" in message, message
    assert "'model.layers.0.mlp.act_fn'" in message, message
    assert report["max_error"] < 1e-5 and report["modules"] > 50, report
    assert 0 < share < 1 and f"{share:.0%} of parameter elements split" in text, text


def _doge_with_transformers_plan():
    from functp.parallel._hf import _auto_plan
    model = _build("doge")
    mesh = functp.make_mesh((2,), ("tp",))
    # transformers' plan as it is: dt_proj row-parallel, its output every head's
    plan = {k: ("rowwise" if k.endswith("dt_proj") else v) for k, v in _auto_plan(model).items()
            if not k.endswith("self_attn")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # (its norms: no rule, replicated)
        apply, params, specs = functp.parallelize(model, mesh, plan)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    step = functp.shard_map(lambda p, i: apply(p, input_ids=i, use_cache=False).logits.sum(),
                            mesh, in_specs=(specs, P()), out_specs=P())
    with pytest.raises(functp.ShardingError) as e:
        step(params, ids)
    return str(e.value)


def test_a_raw_error_under_a_plan_names_the_module_and_its_rules(run):
    message = run(2, _doge_with_transformers_plan)[0]
    assert "module 'model.layers.0.self_attn' (DogeAttention) raised RuntimeError" in message
    assert "'model.layers.0.self_attn.dt_proj'" in message and "'rowwise'" in message, message


def _split_by_auto(model_type):
    model = _build(model_type)
    apply, _, specs = functp.parallelize(model, functp.make_mesh((2,), ("tp",)), "auto")
    return {k for k, s in specs.items() if s.axes}, apply.split_share


def test_auto_splits_the_standard_parts_a_plan_leaves_out(run):
    # GraniteMoE's plan covers only its experts, Qwen2-MoE's not its shared expert:
    # 'auto' adds Megatron rules where they split exactly (the survey checks that)
    split, share = run(2, _split_by_auto, "granitemoe")[0]
    assert "model.layers.0.self_attn.q_proj.weight" in split and share > 0.9, (share, split)
    split, share = run(2, _split_by_auto, "qwen2_moe")[0]
    assert "model.layers.1.mlp.shared_expert.down_proj.weight" in split, split
