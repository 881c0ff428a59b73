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
