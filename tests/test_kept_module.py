"""The module ``parallelize`` keeps is not what trains (issue 50): a ported script's
own ``torch.optim`` optimizer over ``model.parameters()`` (kept copies, or meta
tensors with ``keep_module=False``) refuses its first step on every rank, naming the
blocks; the same optimizer over the blocks trains exactly as on the unsharded model."""
from __future__ import annotations

import copy

import pytest
import torch

import functp
from _oracle import error_text
from functp import P, ShardingError


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, dtype=torch.float64), torch.nn.GELU(),
                               torch.nn.Linear(16, 8, dtype=torch.float64))


_PLAN = {"0": "colwise", "2": "rowwise"}


def _step_kept(keep: bool):
    mesh = functp.make_mesh((2,), ("tp",))
    model = _mlp()
    apply, params, specs = functp.parallelize(model, mesh, _PLAN, keep_module=keep)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)      # the script's own line
    try:
        opt.step()
    except ShardingError as e:
        return str(e)
    return "stepped"


@pytest.mark.parametrize("keep", [True, False])
def test_an_optimizer_over_the_kept_module_refuses_its_first_step(run, keep):
    for msg in run(2, _step_kept, keep):
        assert "AdamW.step()" in msg and "'0.weight'" in msg and "params.values()" in msg, msg
        assert ("meta tensor" in msg) == (not keep), msg


def _train_blocks():
    """Three AdamW steps over the blocks (tape gradients) against three on a copy of
    the unsharded module: the same weights; the module's own copy, deep-copied for
    the reference, is not refused."""
    mesh = functp.make_mesh((2,), ("tp",))
    model = _mlp()
    ref = copy.deepcopy(model)
    apply, params, specs = functp.parallelize(model, mesh, _PLAN)
    blocks = {k: v.requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(blocks.values(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    step = functp.shard_map(lambda p, x: apply(p, x).square().mean(), mesh,
                            in_specs=(specs, P()), out_specs=P())
    for k in range(3):
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        opt.zero_grad()
        step(blocks, x).backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    full = apply.unshard({k: v.detach() for k, v in blocks.items()})
    return max(float((full[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())


def test_the_same_optimizer_over_the_blocks_trains_as_the_unsharded_model(run):
    for err in run(2, _train_blocks):
        assert err <= 1e-12, err


def _state_dicts():
    """The script's ``model.state_dict()``: the initial weights before training (as
    parallelize copied them), refused once the blocks were stepped, read again after
    the trained weights are loaded into the module (strict)."""
    mesh = functp.make_mesh((2,), ("tp",))
    model = _mlp()
    apply, params, specs = functp.parallelize(model, mesh, _PLAN)
    before = model.state_dict()["0.weight"].clone()
    blocks = {k: v.requires_grad_() for k, v in params.items()}
    opt = torch.optim.SGD(blocks.values(), lr=0.1)
    step = functp.shard_map(lambda p, x: apply(p, x).square().mean(), mesh,
                            in_specs=(specs, P()), out_specs=P())
    step(blocks, torch.ones(2, 8, dtype=torch.float64)).backward()
    opt.step()
    try:
        model.state_dict()
        refused = None
    except ShardingError as e:
        refused = str(e)
    trained = apply.state_dict({k: v.detach() for k, v in blocks.items()})
    model.load_state_dict(trained, strict=True)
    after = model.state_dict()["0.weight"]
    return refused, float((after - trained["0.weight"]).abs().max()), bool((after != before).any())


def test_the_kept_modules_state_dict_is_refused_once_the_blocks_trained(run):
    for refused, err, changed in run(2, _state_dicts):
        assert refused is not None and "apply.state_dict(params)" in refused, refused
        assert err == 0.0 and changed, (err, changed)


def _released_state_dict():
    mesh = functp.make_mesh((2,), ("tp",))
    model = _mlp()
    functp.parallelize(model, mesh, _PLAN, keep_module=False)
    try:
        model.state_dict()
    except ShardingError as e:
        return str(e)
    return "read"


def test_a_released_modules_state_dict_is_refused(run):
    for msg in run(2, _released_state_dict):
        assert "meta tensors" in msg, msg


def _resized():
    """``model.resize_token_embeddings`` after parallelize: the next call is refused by
    name (its blocks hold the old rows), where it ran on the new modules' weights."""
    import warnings
    pytest.importorskip("transformers")
    from _hf import VOCAB, _build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build("llama")
    mesh = functp.make_mesh((2,), ("tp",))
    apply, params, specs = functp.parallelize(model, mesh, "auto")
    step = functp.shard_map(lambda p, i: apply(p, input_ids=i, use_cache=False).logits.sum(),
                            mesh, in_specs=(specs, P()), out_specs=P())
    ids = torch.randint(VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    step(params, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    try:
        step(params, ids)
    except ShardingError as e:
        return str(e)
    return "ran"


def test_a_module_resized_after_parallelize_is_refused_by_name(run):
    for msg in run(2, _resized):
        assert "config.vocab_size 32 -> 40" in msg and "resize_token_embeddings" in msg, msg


def _train_eval():
    """``model.train()`` / ``model.eval()`` after parallelize still choose how apply
    runs (apply runs the module): dropout off in eval, exactly the unsharded eval
    output; on in train."""
    mesh = functp.make_mesh((2,), ("tp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, dtype=torch.float64), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 8, dtype=torch.float64))
    ref = copy.deepcopy(model).eval()
    apply, params, specs = functp.parallelize(model, mesh, _PLAN)
    fwd = functp.shard_map(lambda p, x: apply(p, x), mesh, in_specs=(specs, P()), out_specs=P())
    x = torch.ones(4, 8, dtype=torch.float64)
    model.eval()
    err = float((fwd(params, x) - ref(x)).abs().max())
    model.train()
    differs = not torch.equal(fwd(params, x), ref(x))
    return err, differs


def test_train_and_eval_still_choose_how_apply_runs(run):
    for err, differs in run(2, _train_eval):
        assert err <= 1e-12 and differs, (err, differs)


def _clip_lines(shape, tape: bool, keep: bool):
    """A ported script's lines over ``model.parameters()`` once the optimizer is over
    the blocks: each clip, grad-norm log and zeroing raises naming the blocks' way
    (they did nothing: the kept parameters get no gradients); counting parameters
    and printing a .grad still work, and the blocks train as the unsharded model."""
    names = ("dp", "tp") if len(shape) == 2 else ("tp",)
    mesh = functp.make_mesh(shape, names)
    model = _mlp()
    ref = copy.deepcopy(model)
    apply, params, specs = functp.parallelize(model, mesh, _PLAN, keep_module=keep)
    blocks = {k: v.requires_grad_(tape) for k, v in params.items()}
    opt = torch.optim.SGD(blocks.values(), lr=0.1)
    batch = P(names[0]) if len(shape) == 2 else P()
    step = functp.shard_map(lambda p, x: functp.pmean(apply(p, x).square().mean(), names[0]),
                            mesh, in_specs=(specs, batch), out_specs=P())
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    local_x = functp.shard(x, mesh, batch)
    if tape:
        step(blocks, local_x).backward()
    else:
        functp.set_grads(blocks, torch.func.grad(step)(blocks, local_x))
    lines = {
        "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        "foreach": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True),
        "clip_grad_value_": lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1.0),
        "log": lambda: [p.grad.norm() for p in model.parameters() if p.grad is not None],
        "zero_grad(False)": lambda: model.zero_grad(set_to_none=False),
    }
    msgs = {k: error_text(f) for k, f in lines.items()}
    count = sum(p.numel() for p in model.parameters())
    shown = repr(model[0].weight.grad)
    opt.step()
    model.zero_grad()                          # set_to_none: refused at the next call
    msgs["zero_grad()"] = error_text(lambda: step(blocks, local_x))
    ref.zero_grad()
    ref(x).square().mean().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    full = apply.unshard({k: v.detach() for k, v in blocks.items()})
    err = max(float((full[n] - p).abs().max()) for n, p in ref.named_parameters())
    return msgs, count, shown, err


@pytest.mark.parametrize("world,shape,tape,keep", [(2, (2,), True, True), (4, (2, 2), False, True),
                                                   (4, (2, 2), True, False)])
def test_clip_and_zero_grad_over_the_kept_module_raise_naming_the_blocks(run, world, shape,
                                                                        tape, keep):
    for msgs, count, shown, err in run(world, _clip_lines, shape, tape, keep):
        for line, msg in msgs.items():
            if line == "zero_grad()":
                assert "model.zero_grad()" in msg and "optimizer.zero_grad()" in msg, msg
            else:
                assert "of the parallelized Sequential" in msg \
                    and "functp.clip_by_global_norm" in msg \
                    and "functp.global_norm" in msg, (line, msg)
        assert count == 8 * 16 + 16 + 16 * 8 + 8 and "NoGrad('0.weight'" in shown, (count, shown)
        assert err <= 1e-12, err


def _reference_backward():
    """A backward through the kept module itself (a reference run) gives its
    parameters their real gradients, which a clip then acts on as on any module;
    ``model.float()`` moves the kept module with its NoGrad gradients."""
    mesh = functp.make_mesh((2,), ("tp",))
    model = _mlp()
    ref = copy.deepcopy(model)
    functp.parallelize(model, mesh, _PLAN)
    model.float(), ref.float()
    x = torch.ones(2, 8)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    norms = [float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)) for m in (model, ref)]
    return norms, max(float((p.grad - q.grad).abs().max())
                      for p, q in zip(model.parameters(), ref.parameters()))


def test_a_backward_through_the_kept_module_gives_its_real_gradients(run):
    for (norm, ref_norm), err in run(2, _reference_backward):
        assert norm == ref_norm and norm > 0 and err == 0.0, (norm, ref_norm, err)
