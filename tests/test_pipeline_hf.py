"""A transformers model split into pipeline stages by ``parallelize`` on a mesh with a
``pp`` axis (functp/parallel/_pp.py): every schedule's loss and every gradient against
the unsharded float64 model (1e-10), a tied embedding's gradient summed over its two
stages, the model's tensor-parallel plan beside pp, a user's split, and the errors."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import functp
from functp import P

pytest.importorskip("transformers")
import _hf  # noqa: E402

SCHEDULES = [("gpipe", None), ("1f1b", None), ("zero_bubble", None),
             ("interleaved", "v2")]


def _data(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, _hf.VOCAB, (n, _hf.SEQ), generator=g),
            torch.randint(_hf.VOCAB, (n, _hf.SEQ), generator=g))


def _reference(model, ids, tgt):
    apply, full = functp.functionalize(model)
    return torch.func.grad_and_value(
        lambda p: _hf._lm_loss(apply(p, input_ids=ids, use_cache=False).logits, tgt))(full)


def _body(cases, shape, names, layers=4):
    """Each case ``(schedule, tied, stages, backward, microbatches)``: the largest error
    of the loss, of this rank's gradients (gathered over tp) and of ``step.evaluate``'s
    loss on other sequences against the unsharded model's, and which parameters this
    rank held."""
    out = []
    for sched, tied, stages, mode, m in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _hf._build("llama", num_hidden_layers=layers, tie_word_embeddings=tied)
        ids, tgt = _data()
        ref_g, ref_l = _reference(model, ids, tgt)
        mesh = functp.make_mesh(shape, names)
        apply, params, specs = functp.parallelize(model, mesh, "auto", stages=stages)
        step = apply.pipeline(microbatches=m, loss_fn=_hf._lm_loss, schedule=sched,
                              backward=mode)
        loss, grads = step(params, ids, tgt)
        full = apply.unshard(grads)
        chunks = full if isinstance(full, list) else [full]
        err, held = abs(loss.item() - ref_l.item()), []
        held_ids, held_tgt = _data(seed=1)          # (evaluation: forward only)
        with torch.no_grad():
            want = _hf._lm_loss(model(input_ids=held_ids, use_cache=False).logits, held_tgt)
            err = max(err, abs(step.evaluate(params, held_ids, held_tgt).item() - want.item()))
        for c in chunks:
            for k, g in c.items():
                want = ref_g["model.embed_tokens.weight" if tied and k == "lm_head.weight" else k]
                err = max(err, (g - want).abs().max().item())
                held.append(k)
        out.append((sched, tied, mode, err, sorted(held)))
    return out


def _layers_held(held):
    return sorted({int(k.split(".")[2]) for k in held if k.startswith("model.layers.")})


@pytest.mark.parametrize("tied", [False, True])
def test_llama_every_schedule_on_two_stages(run, tied):
    cases = [(s, tied, [1, 1, 1, 1] if v else None, mode, m) for s, v in SCHEDULES
             for mode, m in (("tape", 3), ("func", 4))]
    results = run(2, _body, cases, (2,), ("pp",))
    for rank, rows in enumerate(results):
        for (sched, _, mode, err, held) in rows:
            assert err < 1e-10, (rank, sched, tied, mode, err)
            want = ([0, 2] if rank == 0 else [1, 3]) if sched == "interleaved" else \
                ([0, 1] if rank == 0 else [2, 3])
            assert _layers_held(held) == want, (sched, rank, held)
            assert ("model.embed_tokens.weight" in held) == (rank == 0)
            assert ("lm_head.weight" in held) == (rank == 1)


def test_four_stages_tied_and_uneven(run):
    # 6 layers balanced over 4 stages: 2, 2, 1, 1; the middle stages join the tied
    # gradient's exchange with nothing to send
    cases = [("1f1b", True, None, "tape", 5), ("zero_bubble", True, None, "func", 4),
             ("gpipe", True, [3, 0, 1, 2], "tape", 4)]
    results = run(4, _body, cases, (4,), ("pp",), 6)
    for rank, rows in enumerate(results):
        for i, (sched, _, mode, err, held) in enumerate(rows):
            assert err < 1e-10, (rank, sched, mode, err)
            spans = [[0, 1], [2, 3], [4], [5]] if i < 2 else [[0, 1, 2], [], [3], [4, 5]]
            assert _layers_held(held) == spans[rank], (rank, sched, held)


def test_tensor_parallel_plan_beside_pp(run):
    # (pp, tp) = (2, 2): each stage laid out by Llama's tp plan, the tied embedding
    # split over the vocabulary on both of its stages
    cases = [("1f1b", True, None, "tape", 3), ("zero_bubble", True, None, "func", 3),
             ("interleaved", False, [1, 1, 1, 1], "tape", 2), ("gpipe", False, [3, 1], "func", 3)]
    results = run(4, _body, cases, (2, 2), ("pp", "tp"))
    for rank, rows in enumerate(results):
        for (sched, tied, mode, err, held) in rows:
            assert err < 1e-10, (rank, sched, tied, mode, err)
            assert ("model.embed_tokens.weight" in held) == (rank // 2 == 0)


def test_data_parallel_beside_pp(run):
    # (dp, pp) = (2, 2): each dp row pipes its own 3 of the 6 sequences; the loss and
    # the gradients are the rows' means, equal to the unsplit model's on the whole batch
    cases = [(s, tied, [1, 1, 1, 1] if v else None, mode, 3) for s, v in SCHEDULES
             for tied, mode in ((True, "tape"), (False, "func"))]
    for rank, rows in enumerate(run(4, _body, cases, (2, 2), ("dp", "pp"))):
        for (sched, tied, mode, err, held) in rows:
            assert err < 1e-10, (rank, sched, tied, mode, err)
            assert ("model.embed_tokens.weight" in held) == (rank % 2 == 0), (rank, held)


@pytest.mark.parametrize("names", [("dp", "pp", "tp"), ("pp", "dp", "tp")])
def test_data_parallel_and_tensor_parallel_beside_pp(run, names):
    cases = [("1f1b", True, None, "tape", 3), ("zero_bubble", False, None, "func", 2),
             ("interleaved", True, [1, 1, 1, 1], "tape", 3), ("gpipe", False, [3, 1], "tape", 3)]
    for rank, rows in enumerate(run(8, _body, cases, (2, 2, 2), names)):
        for (sched, tied, mode, err, _) in rows:
            assert err < 1e-10, (names, rank, sched, tied, mode, err)


def test_fsdp_beside_pp(run):
    # (pp, fsdp) and (fsdp, pp, tp): each stage's blocks split over fsdp, whose ranks
    # pipe their own rows of the batch; gathered once a step, reduce-scattered once
    cases = [("1f1b", True, None, "tape", 3), ("interleaved", False, [1, 1, 1, 1], "func", 3)]
    for rank, rows in enumerate(run(4, _body, cases, (2, 2), ("pp", "fsdp"))):
        for (sched, tied, mode, err, held) in rows:
            assert err < 1e-10, (rank, sched, tied, mode, err)
            assert ("model.embed_tokens.weight" in held) == (rank // 2 == 0), (rank, held)
    for rank, rows in enumerate(run(8, _body, [("zero_bubble", True, None, "func", 3)],
                                    (2, 2, 2), ("fsdp", "pp", "tp"))):
        assert rows[0][3] < 1e-10, (rank, rows)


def _moe_body(model_type, shape, names, schedule, mode):
    """A MoE model pipelined on ``names``: the loss's and the gradients' largest error
    against the unsplit float64 model's, and this rank's local shape of layer 0's
    experts' gate_up weight (split over ep: half the experts) and its spec."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf._build(model_type, num_hidden_layers=2)
    ids, tgt = _data(8)
    ref_g, ref_l = _reference(model, ids, tgt)
    apply, params, specs = functp.parallelize(model, functp.make_mesh(shape, names), "auto")
    step = apply.pipeline(microbatches=2, loss_fn=_hf._lm_loss, schedule=schedule,
                          backward=mode)
    loss, grads = step(params, ids, tgt)
    err = max([abs(loss.item() - ref_l.item())] + [
        (g - ref_g[k]).abs().max().item() for k, g in apply.unshard(grads).items()])
    experts = [k for k in params if ".experts." in k and "gate_up" in k]
    want = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_g.values()]))
    norm = functp.global_norm(grads, pipeline=apply)
    return err, [(tuple(params[k].shape), specs[k]) for k in experts], abs(norm / want - 1)


def test_ep_beside_pp(run):
    # (pp, ep), (ep, pp), (dp, pp, ep), (pp, ep, fsdp) and with tp: each stage's experts split
    # over ep, whose ranks pipe their own rows of the batch (the dense blocks' gradients
    # summed over ep, the experts' not: each holds its own experts' whole gradient)
    for model_type, shape, names, schedule, mode in [
            ("qwen3_moe", (2, 2), ("pp", "ep"), "1f1b", "tape"),
            ("mixtral", (2, 2), ("ep", "pp"), "zero_bubble", "func"),
            ("qwen3_moe", (2, 2, 2), ("dp", "pp", "ep"), "gpipe", "func"),
            ("qwen3_moe", (2, 2, 2), ("pp", "ep", "fsdp"), "1f1b", "tape"),
            # (tp beside ep: the stage's dense blocks split over tp, its experts over ep)
            ("qwen3_moe", (2, 2, 2), ("pp", "ep", "tp"), "1f1b", "tape"),
            ("mixtral", (2, 2, 2), ("tp", "ep", "pp"), "zero_bubble", "func")]:
        for rank, (err, experts, norm) in enumerate(run(math.prod(shape), _moe_body,
                                                        model_type, shape, names, schedule, mode)):
            assert err < 1e-10 and norm < 1e-12, (model_type, names, rank, err, norm)
            assert experts and all("ep" in spec.axes for _, spec in experts), experts


def _fsdp_collectives_body(m):
    """A (pp, fsdp) 1F1B step of ``m`` microbatches: its collectives over fsdp, and
    the local and the whole shapes of this rank's first layer's q_proj."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf._build("llama", num_hidden_layers=2)
    ids, tgt = _data(4)
    mesh = functp.make_mesh((2, 2), ("pp", "fsdp"))
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    step = apply.pipeline(microbatches=m, loss_fn=_hf._lm_loss, schedule="1f1b")
    with functp.comm_log() as log:
        _, grads = step(params, ids, tgt)
    name = next(k for k in params if ".q_proj." in k)
    return (sorted(e.op for e in log.events if "fsdp" in e.axes), tuple(grads[name].shape),
            tuple(apply.unshard(grads)[name].shape), specs[name])


def test_fsdp_beside_pp_gathers_and_reduces_once_a_step(run):
    # one all-gather of the stage's blocks and one reduce-scatter of their gradients
    # (float weights split over fsdp: one dtype), whatever the microbatch count; the
    # norms' (32,) weights split too (32 is a multiple of 2), so nothing is all-reduced
    for m in (1, 2):
        for ops, local, whole, spec in run(4, _fsdp_collectives_body, m):
            assert ops == ["all_gather", "all_reduce", "reduce_scatter"], (m, ops)
            assert (local, whole, spec) == ((16, 32), (32, 32), P("fsdp")), (local, whole, spec)


def _dp_collectives_body():
    """The collectives over dp of a (dp, pp, tp) step of 3 microbatches: the rows'
    loss and their gradients, one all-reduce per dtype and split (none per
    microbatch: the stages' backward leaves them unreduced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf._build("llama", num_hidden_layers=4)
    ids, tgt = _data()
    mesh = functp.make_mesh((2, 2, 2), ("dp", "pp", "tp"))
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    step = apply.pipeline(microbatches=3, loss_fn=_hf._lm_loss, schedule="1f1b")
    with functp.comm_log() as log:
        step(params, ids, tgt)
    return [e.op for e in log.events if "dp" in e.axes], apply.batch_axes


def test_data_parallel_beside_pp_reduces_once_per_step(run):
    for ops, batch_axes in run(8, _dp_collectives_body):
        # the loss; the blocks split over tp and those replicated over it
        assert ops == ["all_reduce"] * 3, ops
        assert batch_axes == ("dp",)


def _norms_body(shape, names, kind, schedule):
    """The whole model's gradient norm from a pipelined step's gradients
    (``global_norm(pipeline=apply)``, p = 2, 1, inf) against the unsplit model's, and
    the clip's factor against the unsplit clip's: ``[(p, error)]``."""
    from functp.models import LLAMA_TP_PLAN, Llama, LlamaConfig
    torch.manual_seed(0)
    if kind == "functp":       # functp's own Llama, by its _pp_plan and tp plan
        model = Llama(LlamaConfig(vocab_size=_hf.VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=4)).double()
        plan, fwd = LLAMA_TP_PLAN, lambda a, p, ids: a(p, ids)
    else:                      # a tied transformers Llama: its embedding counted once
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _hf._build("llama", num_hidden_layers=4, tie_word_embeddings=True)
        plan, fwd = "auto", lambda a, p, ids: a(p, input_ids=ids, use_cache=False).logits
    ids, tgt = _data(8)
    ref_apply, full = functp.functionalize(model)
    ref = torch.func.grad(lambda p: _hf._lm_loss(fwd(ref_apply, p, ids), tgt))(full)
    mesh = functp.make_mesh(shape, names)
    apply, params, _ = functp.parallelize(model, mesh, plan, axis="tp")
    _, grads = apply.pipeline(microbatches=4, loss_fn=_hf._lm_loss, schedule=schedule)(
        params, ids, tgt)
    out = []
    for p in (2.0, 1.0, math.inf):
        want = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, p) for g in ref.values()]), p)
        got = functp.global_norm(grads, pipeline=apply, norm_type=p)
        out.append((p, abs(got.item() - want.item()) / want.item()))
    if apply.stage_mesh is not None:      # (one stage's norm: refused, naming the fix)
        with pytest.raises(functp.ShardingError, match="pass pipeline=apply"):
            functp.clip_by_global_norm(grads, 0.1, apply.stage_mesh, apply.specs[0])
    clipped, norm = functp.clip_by_global_norm(grads, 0.1, pipeline=apply)
    mine = apply.unshard(clipped)
    coef = 0.1 / (norm + 1e-6)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if kind != "functp" else {}
    out.append(("clip", max((g - coef * ref[tied.get(k, k)]).abs().max().item()
                            for k, g in mine.items())))
    return out


@pytest.mark.parametrize("kind", ["functp", "transformers_tied"])
def test_the_global_norm_of_a_pipelines_gradients_is_the_whole_models(run, kind):
    # (a stage's own norm clips each stage by another factor: examples/train_lm.py --pp
    # then trained to other losses from its second step; over apply.stage_mesh that
    # norm is refused)
    for shape, names, schedule in [((2, 2, 2), ("dp", "pp", "tp"), "1f1b"),
                                   ((2,), ("pp",), "zero_bubble"),
                                   ((2, 2), ("pp", "fsdp"), "gpipe")]:
        for rank in run(math.prod(shape), _norms_body, shape, names, kind, schedule):
            for what, err in rank:
                assert err <= 1e-12, (shape, what, err)


def _estimated_step(shape, names, backward):
    import transformers
    config = transformers.LlamaConfig(vocab_size=_hf.VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2)
    apply, params, _ = functp.parallelize(transformers.LlamaForCausalLM(config),
                                          functp.make_mesh(shape, names), "auto")
    ids = torch.randint(3, _hf.VOCAB, (4, _hf.SEQ))
    step = apply.pipeline(microbatches=2, loss_fn=_hf._lm_loss, schedule="1f1b",
                          backward=backward)
    return step(params, ids, ids)


@pytest.mark.parametrize("backward", ["tape", "func"])
def test_estimate_of_a_transformers_pipeline_with_dp_and_tp(backward):
    # the stages' modules under the estimate's MemTracker and FlopCounterMode, whose
    # module hooks see a stage's input (before: a leaf, which autograd.grad refused
    # them), and the stage mesh's check mode agreed where the mesh's was (before: a
    # real collective in the dry world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = functp.estimate(_estimated_step, 8, (2, 2, 2), ("dp", "pp", "tp"), backward,
                              hardware="h100-sxm")
    summary = est.comm.summary()
    assert summary[("all_reduce", ("dp",))] == 3 and summary[("permute", ("pp",))] > 0, summary
    assert all(est[r].peak_bytes > 0 and est[r].seconds.idle > 0 for r in est.ranks)
    if backward == "tape":      # fsdp beside pp: its gather and reduce-scatter predicted
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = functp.estimate(_estimated_step, 8, (2, 2, 2), ("fsdp", "pp", "tp"), backward)
        summary = est.comm.summary()
        # (once a step each, for the tp-split blocks and the others: two buffers)
        assert (summary[("all_gather", ("fsdp",))], summary[("reduce_scatter", ("fsdp",))],
                summary[("all_reduce", ("fsdp",))]) == (2, 2, 1), summary


def _estimated_moe_step():
    model = _hf._built("qwen3_moe", num_hidden_layers=2)   # (in the trace: no .double())
    apply, params, _ = functp.parallelize(
        model, functp.make_mesh((2, 2, 2), ("pp", "ep", "tp")), "auto")
    ids = torch.randint(3, _hf.VOCAB, (4, _hf.SEQ))
    return apply.pipeline(microbatches=2, loss_fn=_hf._lm_loss, schedule="1f1b")(
        params, ids, ids)


def test_estimate_of_a_moe_pipeline_with_ep_and_tp():
    # the experts' dispatch over ep within each stage, and the step's reductions over
    # ep once a step: the loss and two gradient buffers (the tp-split dense blocks and
    # the replicated ones), none for the experts (each rank holds its own whole)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = functp.estimate(_estimated_moe_step, 8)
    summary = est.comm.summary()
    assert summary[("ragged_all_to_all", ("ep",))] > 0, summary
    assert summary[("all_reduce", ("ep",))] == 3, summary
    assert all(est[r].peak_bytes > 0 for r in est.ranks)


def _blocks_body():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf._build("llama", num_hidden_layers=4, tie_word_embeddings=True)
    mesh = functp.make_mesh((2, 2), ("pp", "tp"))
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    return (repr(apply), {k: tuple(v.shape) for k, v in params.items()
                          if "embed" in k or "lm_head" in k or "layers.0.mlp.up" in k
                          or "layers.2.mlp.up" in k},
            {k: repr(s) for k, s in specs.items() if "embed" in k or "lm_head" in k})


def test_stage_blocks_and_specs(run):
    out = run(4, _blocks_body)
    assert out[0][0] == "PipelineStages(LlamaForCausalLM, stage 0 of 2, decoder layers 0..1)"
    assert out[3][0] == "PipelineStages(LlamaForCausalLM, stage 1 of 2, decoder layers 2..3)"
    # vocabulary 32 split over tp=2 on both holders; the MLP's 32 columns too
    assert out[0][1] == {"model.embed_tokens.weight": (16, 32),
                         "model.layers.0.mlp.up_proj.weight": (16, 32)}
    assert out[2][1] == {"lm_head.weight": (16, 32), "model.layers.2.mlp.up_proj.weight": (16, 32)}
    assert out[0][2] == {"model.embed_tokens.weight": "P('tp', None)"}
    assert out[2][2] == {"lm_head.weight": "P('tp', None)"}


def test_on_gloo_processes(run):
    # the point-to-point transfers and the tied gradient's exchange between processes
    cases = [("1f1b", True, None, "tape", 3), ("zero_bubble", True, None, "func", 3)]
    for names in (("pp", "tp"), ("dp", "pp")):     # (dp: each row's own pp groups)
        for rank, rows in enumerate(run(4, _body, cases, (2, 2), names, gloo=True)):
            for (sched, _, mode, err, _) in rows:
                assert err < 1e-10, (names, rank, sched, mode, err)


def _trained(tied: bool):
    """A tiny Llama whose weights are no longer their initial values (every rank
    alike), so a load that returns fresh blocks cannot pass for one that read them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf._build("llama", num_hidden_layers=4, tie_word_embeddings=tied)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _checkpoint_body(path: str, tied: bool):
    """Saves pp2 x tp2's stages (each its own layers), then loads the checkpoint on
    pp4, on dp2 x tp2 without a pipeline, on pp2 x fsdp2 and whole on one process: the largest
    difference from the model's own tensors in each, and the keys each held."""
    model = _trained(tied)
    mesh = functp.make_mesh((2, 2), ("pp", "tp"))
    _, params, specs = functp.parallelize(model, mesh, "auto")
    functp.save(path, {"params": params, "step": 5}, mesh, {"params": specs, "step": P()})
    want = dict(model.state_dict())
    out = []
    for shape, names in (((4,), ("pp",)), ((2, 2), ("dp", "tp")), ((2, 2), ("pp", "fsdp"))):
        other = functp.make_mesh(shape, names)
        apply, blocks, their = functp.parallelize(model, other, "auto")
        like = {"params": {k: torch.zeros_like(v) for k, v in blocks.items()}, "step": 0}
        got = functp.load(path, other, {"params": their, "step": P()}, like=like)
        full = apply.unshard(got["params"])
        out.append((names, got["step"], sorted(full), max(
            (full[k] - want[k]).abs().max().item() for k in full)))
    whole = functp.load(path)["params"]
    out.append((None, 5, sorted(whole), max((whole[k] - want[k]).abs().max().item()
                                            for k in whole)))
    # the stages written as one transformers folder, which transformers loads whole
    import transformers
    folder = path + "_hf"
    functp.save_pretrained(folder, params, specs, mesh, model.config)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.float64, output_loading_info=True)
    got = loaded.state_dict()
    out.append((info["missing_keys"], info["unexpected_keys"], sorted(got),
                max((got[k] - want[k]).abs().max().item() for k in want)))
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_of_stages_loads_on_another_pp_size_and_without_pp(run, tmp_path, tied):
    # pp2 x tp2 -> pp4 (each rank one layer), -> dp2 x tp2, -> pp2 x fsdp2, -> one process, and as a
    # transformers folder: equal to the model's tensors bit for bit (float64, moved)
    model = _trained(tied)
    names = sorted(model.state_dict())
    results = run(4, _checkpoint_body, str(tmp_path / "ckpt"), tied, gloo=True)
    for rank, rows in enumerate(results):
        (_, s4, keys4, e4), (_, s2, keys2, e2), (_, sf, keysf, ef), (_, _, whole, ew), hf = rows
        assert (s4, s2, sf, e4, e2, ef, ew) == (5, 5, 5, 0.0, 0.0, 0.0, 0.0), (rank, rows)
        # (pp2 x fsdp2: each rank its half of its stage's blocks, read from tp's halves)
        assert ("model.layers.3.mlp.up_proj.weight" in keysf) == (rank >= 2), (rank, keysf)
        # save_pretrained: every stage's weights, the tied one once
        assert (list(hf[0]), list(hf[1]), hf[2], hf[3]) == ([], [], names, 0.0), (rank, hf)
        assert whole == names, (rank, whole)               # every stage's keys
        assert f"model.layers.{rank}.mlp.up_proj.weight" in keys4, (rank, keys4)
        assert len([k for k in keys4 if ".layers." in k]) == 9, keys4    # one layer
        assert ("lm_head.weight" in keys4) == (rank == 3 or False), (rank, keys4)
        assert "model.layers.3.mlp.up_proj.weight" in keys2, keys2      # all layers


# -- what is refused, with the reason, on every rank -----------------------------------------

def _verify_body():
    """parallelize(verify=True) on (pp, tp): the collectives over tp it runs (the plan
    checked on the whole model) and those without verify=, and the error of a plan
    that leaves o_proj out (attention's heads split, its output projection whole)."""
    from functp.parallel._hf import _auto_plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf._build("llama", num_hidden_layers=4)
    mesh = functp.make_mesh((2, 2), ("pp", "tp"))
    counts = []
    for verify in (True, False):
        with functp.comm_log() as log:
            functp.parallelize(model, mesh, "auto", verify=verify)
        counts.append(len([e for e in log.events if e.axes == ("tp",)]))
    bad = {k: v for k, v in _auto_plan(model).items() if not k.endswith("o_proj")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # (o_proj: no rule covers it)
        functp.parallelize(model, mesh, bad)         # (laid out: it fails in the step)
        with pytest.raises(functp.ShardingError) as e:
            functp.parallelize(model, mesh, bad, verify=True)
    return counts, str(e.value)


def test_verify_checks_the_plan_beside_a_pipeline(run):
    for counts, message in run(4, _verify_body):
        assert counts[0] > 0 and counts[1] == 0, counts
        assert ("module 'model.layers.0.self_attn.o_proj' (Linear) raised RuntimeError "
                "under the plan") in message, message


def _error_body(case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf._build("llama", num_hidden_layers=4)
    mesh = (functp.make_mesh((2, 2), ("pp", case)) if case == "cp" else
            functp.make_mesh((2, 2), ("dp", "pp")) if case == "uneven" else
            functp.make_mesh((2,), ("pp",)))
    try:
        if case == "sum":
            functp.parallelize(model, mesh, "auto", stages=[3, 2])
        elif case == "count":
            functp.parallelize(model, mesh, "auto", stages=[4, 0, 0])
        elif case == "too_few":
            functp.parallelize(model, mesh, "auto", stages=[1] * 8)
        elif case == "no_plan":
            functp.parallelize(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh, {})
        elif case == "cp":
            functp.parallelize(model, mesh, "auto")
        elif case == "uneven":
            apply, params, _ = functp.parallelize(model, mesh, "auto")
            ids, tgt = _data(5)
            apply.pipeline(microbatches=2, loss_fn=_hf._lm_loss)(params, ids, tgt)
        elif case == "interleaved":
            apply, params, _ = functp.parallelize(model, mesh, "auto")
            apply.pipeline(microbatches=2, loss_fn=_hf._lm_loss, schedule="interleaved")
    except functp.ShardingError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case, says", [
    ("sum", r"stages=\[3, 2\] must give the number of decoder layers of each of the 2 "
            r"pipeline stages .* summing to the model's 4 layers"),
    ("count", r"stages=\[4, 0, 0\] must list the decoder layers of each pipeline stage: pp=2"),
    ("too_few", r"stages=\[1, 1, 1, 1, 1, 1, 1, 1\] must give .* summing to the model's 4"),
    ("no_plan", r"Sequential has no transformers pipeline plan .* functp.pipeline"),
    ("cp", r"may have the plan's 'tp' .* and data-parallel axes .* \['cp'\]: context "
           r"parallelism beside a pipeline is not built yet \('fsdp' and 'ep' are\)"),
    ("uneven", r"batch's 5 sequences .* must split evenly over the data-parallel axes "
               r"\['dp'\] \(2 rows"),
    ("interleaved", r"schedule='interleaved'.*1 virtual stage.*stages=\) with pp x v"),
])
def test_refused_on_every_rank(run, case, says):
    import re
    out = run({"cp": 4, "uneven": 4}.get(case, 2), _error_body, case)
    assert all(o is not None and re.search(says, o) for o in out), out
