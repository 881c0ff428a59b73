"""The compiled whole train step (gradients, clip_by_global_norm, functp.adamw) beyond
test_whole_step's MLP on 2 ranks: dp x tp on 4 ranks, transformers models through
parallelize(model, mesh, "auto") (tied embeddings and a sliding window, MoE experts with
packed weights, MLA), leaves that require grad or not; and the functp error, before
Dynamo's message, for a model that cannot be one graph for a reason of its own (issue 54).

aot_eager throughout: what functp adds is decided before the backend runs (Inductor's
case is test_whole_step's)."""
from __future__ import annotations

import warnings

import optree
import pytest
import torch

import functp
from functp import P
from _oracle import assert_tree_close
from test_whole_step import MAX_NORM, _Census, _compiled_case, _grads_by

GLOO = True
_NEW_TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
_OLD = "torch 2.11's Dynamo cannot trace the whole step (see test_whole_step)"


def _dp_tp_body():
    # tape autograd, leaves that require grad (nn.Parameter-like), donated buffers
    _compiled_case("dp_tp", "tape", donate=True, requires_grad=True, shape=(2, 2))


@pytest.mark.skipif(not _NEW_TORCH, reason=_OLD)
def test_the_compiled_dp_x_tp_step_on_4_ranks_is_one_graph_equal_to_eager(run):
    run(4, _dp_tp_body, timeout=900)


def _hf_train_step(model_type: str, way: str, fields: dict):
    import _hf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # transformers' notes about tiny configs
        model = _hf._build(model_type, num_hidden_layers=1, **fields)
    mesh = functp.make_mesh((2,), ("tp",))
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    g = torch.Generator().manual_seed(0)
    batch = functp.shard((torch.randint(3, _hf.VOCAB, (_hf.BATCH, _hf.SEQ), generator=g),
                          torch.randint(_hf.VOCAB, (_hf.BATCH, _hf.SEQ), generator=g)),
                         mesh, P())
    step = functp.shard_map(
        lambda p, i, t: _hf._lm_loss(apply(p, input_ids=i, use_cache=False).logits, t),
        mesh, in_specs=(specs, P(), P()), out_specs=P())
    opt = functp.adamw(1e-2, weight_decay=0.1)
    grads_of = _grads_by(way, step)

    def train_step(p, s, i, t):
        g = grads_of(p, i, t)
        g, norm = functp.clip_by_global_norm(g, MAX_NORM, mesh, specs)
        return (norm, *opt.update(p, g, s))
    return train_step, params, opt, batch


# (model, way, leaves require grad, fields): each case a user hits, one way each
_HF = [
    ("gemma3_text", "functp.value_and_grad", True,        # tied embeddings, sliding window
     dict(tie_word_embeddings=True, sliding_window=4, attn_implementation="sdpa")),
    ("qwen3_moe", "tape", False,                          # MoE experts, packed gate_up
     dict(experts_implementation="batched_mm")),
    ("deepseek_v3", "torch.func.grad", True,              # MLA (its one layer: dense)
     dict(experts_implementation="batched_mm")),
]


def _hf_body():
    import torch._dynamo
    from torch._dynamo.utils import counters
    done = []
    for model_type, way, requires_grad, fields in _HF:
        train_step, params, opt, (ids, tgt) = _hf_train_step(model_type, way, fields)
        params = {k: v.detach().requires_grad_(requires_grad) for k, v in params.items()}
        with functp.comm_log() as log:
            want = optree.tree_map(torch.clone, train_step(params, opt.init(params), ids, tgt))
        torch._dynamo.reset()
        counters.clear()
        census = _Census()
        old = torch._dynamo.config.trace_autograd_ops
        torch._dynamo.config.trace_autograd_ops = way == "tape"
        try:
            with census.census:
                got = torch.compile(train_step, fullgraph=True, backend=census.backend)(
                    params, opt.init(params), ids, tgt)
        finally:
            torch._dynamo.config.trace_autograd_ops = old
        what = f"{model_type} {way} requires_grad={requires_grad}"
        # one graph, no break (Gemma-3 with SDPA and leaves that require grad is
        # traced twice into that one graph: the backend is called twice, the graphs
        # AOTAutograd makes counted once)
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (
            what, dict(counters["stats"]), dict(counters["graph_break"]))
        assert not census.syncs, f"{what}: host reads {census.syncs}"
        assert len(census.collectives) == len(log), (
            what, census.graphs, sorted(census.collectives), log.summary())
        assert_tree_close(got, want, what)
        done.append(model_type)
    return done


@pytest.mark.skipif(not _NEW_TORCH, reason=_OLD)
def test_compiled_whole_step_of_transformers_models_equals_eager(run):
    pytest.importorskip("transformers")
    assert run(2, _hf_body, timeout=900)[0] == [m for m, *_ in _HF]


def _eager_experts_body():
    import torch._dynamo
    train_step, params, opt, (ids, tgt) = _hf_train_step(
        "qwen3_moe", "torch.func.grad", dict(experts_implementation="eager"))
    torch._dynamo.reset()
    with pytest.raises(Exception) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(train_step, fullgraph=True, backend="aot_eager")(
            params, opt.init(params), ids, tgt)
    # functp's text is the error's own, Dynamo's after it; a ShardingError its cause
    text = str(info.value)
    assert text.startswith("torch.compile(fullgraph=True) cannot make one graph of the "
                           "shard_map body"), text
    assert "module 'model.layers.0.mlp.experts' (Qwen3MoeExperts)" in text, text
    assert "experts_implementation='batched_mm'" in text, text
    assert isinstance(info.value.__cause__, functp.ShardingError), repr(info.value.__cause__)


@pytest.mark.skipif(not _NEW_TORCH, reason=_OLD)
def test_a_model_that_branches_on_values_gets_functps_error_first(run):
    pytest.importorskip("transformers")
    run(2, _eager_experts_body, timeout=900)
