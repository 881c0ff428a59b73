"""A fine-tuning loop of the kind transformers' no-trainer scripts write (issue 50),
ported to (dp=2, tp=2): AdamW with a no-decay group for biases and norms, a linear
warm-up schedule, gradient accumulation over two micro-batches and a global-norm clip
train the blocks exactly as the same loop trains the unsharded float64 model; the
script's unchanged lines over the module (its optimizer, its state dict) raise, naming
the blocks."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import functp
from _oracle import error_text
from functp import P, ShardingError

pytest.importorskip("transformers")
from _hf import VOCAB, _build, _lm_loss  # noqa: E402

NO_DECAY = ("bias", "norm")


def _groups(named, weight_decay=0.1):
    named = list(named)
    return [{"params": [p for n, p in named if not any(k in n for k in NO_DECAY)],
             "weight_decay": weight_decay},
            {"params": [p for n, p in named if any(k in n for k in NO_DECAY)],
             "weight_decay": 0.0}]


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))


def _batches(steps=3, accumulate=2):
    g = torch.Generator().manual_seed(7)
    return [[(torch.randint(VOCAB, (4, 8), generator=g), torch.randint(VOCAB, (4, 8), generator=g))
             for _ in range(accumulate)] for _ in range(steps)]


def _finetune():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build("llama", tie_word_embeddings=True)
    ref = copy.deepcopy(model)
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    params = {k: v.requires_grad_() for k, v in params.items()}
    # the script's own line, unchanged: refused at its first step
    try:
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
        kept = "stepped"
    except ShardingError as e:
        kept = str(e)
    opt = torch.optim.AdamW(_groups(params.items()), lr=1e-2)
    sched = _schedule(opt)
    ref_opt = torch.optim.AdamW(_groups(ref.named_parameters()), lr=1e-2)
    ref_sched = _schedule(ref_opt)
    step = functp.shard_map(
        lambda p, i, t: functp.pmean(_lm_loss(apply(p, input_ids=i, use_cache=False).logits, t), "dp"),
        mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P())
    for micro in _batches():
        for ids, tgt in micro:                     # accumulation: loss / 2 each
            (step(params, *functp.shard((ids, tgt), mesh, P("dp"))) / len(micro)).backward()
            (_lm_loss(ref(input_ids=ids, use_cache=False).logits, tgt) / len(micro)).backward()
        grads, _ = functp.clip_by_global_norm({k: p.grad for k, p in params.items()}, 0.5,
                                              mesh, specs)
        functp.set_grads(params, grads)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
    try:
        model.state_dict()                         # the script's checkpoint line
        stale = "read"
    except ShardingError as e:
        stale = str(e)
    model.load_state_dict(apply.state_dict({k: v.detach() for k, v in params.items()}))
    got, want = model.state_dict(), ref.state_dict()
    err = max(float((got[k] - want[k]).abs().max()) for k in want)
    return kept, stale, sorted(got) == sorted(want), err


def test_a_ported_finetuning_loop_trains_the_blocks_as_the_unsharded_model(run):
    for kept, stale, same_keys, err in run(4, _finetune):
        assert "AdamW.step()" in kept and "params.values()" in kept, kept
        assert "apply.state_dict(params)" in stale, stale
        assert same_keys and err <= 1e-10, err


# -- a grown vocabulary: functp.resize_token_embeddings --------------------------------

NEW = VOCAB + 8


def _sgd(params: dict, grads: dict) -> dict:
    return {k: (v - 0.1 * grads[k]).detach() for k, v in params.items()}


def _grads(apply, specs, mesh, params, ids, dp: bool):
    batch = P("dp") if dp else P()
    step = functp.shard_map(
        lambda p, i: functp.pmean(_lm_loss(apply(p, input_ids=i, use_cache=False).logits, i), "dp")
        if dp else _lm_loss(apply(p, input_ids=i, use_cache=False).logits, i),
        mesh, in_specs=(specs, batch), out_specs=P())
    return torch.func.grad(step)(params, functp.shard(ids, mesh, batch))


def _ref_step(ref, ids):
    named = dict(ref.named_parameters())
    g = torch.func.grad(lambda p: _lm_loss(torch.func.functional_call(
        ref, p, (ids,), {"use_cache": False}).logits, ids))(named)
    with torch.no_grad():
        for k, p in named.items():
            p -= 0.1 * g[k]


def _max_err(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _resize(tied: bool, mean: bool, shape, keep: bool):
    """One step, then the vocabulary grown by 8 (the same seed as transformers' own
    resize of the unsharded model trained alike), then a step on ids that use the new
    rows: every state-dict key as the unsharded float64 model's, at each point."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build("llama", tie_word_embeddings=tied)
        ref = copy.deepcopy(model)
        dp = len(shape) == 2
        mesh = functp.make_mesh(shape, ("dp", "tp") if dp else ("tp",))
        apply, params, specs = functp.parallelize(model, mesh, "auto", keep_module=keep)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(VOCAB, (4, 6), generator=g)
        params = _sgd(params, _grads(apply, specs, mesh, params, ids, dp))
        _ref_step(ref, ids)
        old = apply
        torch.manual_seed(5 + functp.process_index())   # (rank 0's draw is the one kept)
        apply, params, specs = functp.resize_token_embeddings(apply, params, NEW,
                                                              mean_resizing=mean)
        torch.manual_seed(5)
        ref.resize_token_embeddings(NEW, mean_resizing=mean)
        resized = _max_err(apply.state_dict(params), ref.state_dict())
        stale = error_text(lambda: _grads(old, specs, mesh, params, ids, dp))
        ids = torch.randint(NEW, (4, 6), generator=g)
        params = _sgd(params, _grads(apply, specs, mesh, params, ids, dp))
        _ref_step(ref, ids)
        trained = _max_err(apply.state_dict(params), ref.state_dict())
    emb = specs["model.embed_tokens.weight"]
    return resized, trained, apply.module.config.vocab_size, str(emb), stale


@pytest.mark.parametrize("tied,mean,world,shape,keep", [
    (True, True, 4, (2, 2), True), (False, True, 2, (2,), False),
    (True, False, 2, (2,), True), (False, False, 4, (2, 2), True)])
def test_resize_token_embeddings_grows_the_blocks_as_transformers_does(run, tied, mean, world,
                                                                       shape, keep):
    for resized, trained, vocab, emb, stale in run(world, _resize, tied, mean, shape, keep):
        assert resized <= 1e-12 and trained <= 1e-12, (resized, trained)
        assert vocab == NEW and emb == "P('tp', None)", (vocab, emb)
        assert "config.vocab_size 32 -> 40" in stale, stale


def _from_pretrained(path: str, out: str):
    """A from_pretrained model (meta module): its own resize_token_embeddings (both
    initialisations) raises naming functp's, on every rank; functp's resizes as
    transformers does on the model it loads, a size the split does not divide is
    refused before anything changes, and save_pretrained writes a config that agrees."""
    import transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = functp.make_mesh((2, 2), ("dp", "tp"))
        apply, params, specs = functp.from_pretrained(path, mesh)
        direct = [error_text(lambda: apply.module.resize_token_embeddings(NEW, mean_resizing=m))
                  for m in (True, False)]
        odd = error_text(lambda: functp.resize_token_embeddings(apply, params, NEW + 1))
        torch.manual_seed(5)
        apply, params, specs = functp.resize_token_embeddings(apply, params, NEW + 1,
                                                              pad_to_multiple_of=4)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path)
        torch.manual_seed(5)
        ref.resize_token_embeddings(NEW + 1, pad_to_multiple_of=4)
        err = _max_err(apply.state_dict(params), ref.state_dict())
        functp.save_pretrained(out, params, specs, mesh, apply.module.config)
    return direct, odd, err


def test_a_from_pretrained_models_vocabulary_grows_through_functp(run, tmp_path):
    import json

    import transformers
    from safetensors import safe_open
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path, out = str(tmp_path / "tiny"), str(tmp_path / "resized")
        _build("llama", tie_word_embeddings=False).save_pretrained(path)
        for direct, odd, err in run(4, _from_pretrained, path, out):
            for msg in direct:
                assert "functp.resize_token_embeddings(apply, params, new_num_tokens)" in msg, msg
            assert "pad_to_multiple_of=2" in odd and "41" in odd, odd
            assert err <= 1e-12, err
        with open(f"{out}/config.json") as f:
            assert json.load(f)["vocab_size"] == 44
        shapes = {}
        for name in [f for f in __import__("os").listdir(out) if f.endswith(".safetensors")]:
            with safe_open(f"{out}/{name}", "pt") as f:
                shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
        assert shapes["model.embed_tokens.weight"][0] == shapes["lm_head.weight"][0] == 44, shapes
        back = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert back.get_input_embeddings().weight.shape[0] == 44
