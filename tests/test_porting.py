"""What a ported single-file GPT training script relies on (issue 50), on a tiny GPT
written here (fused qkv ``c_attn`` split by width, tied ``wte``/``lm_head``, a causal
mask buffer) and a tiny transformers model with tied embeddings: the trained blocks
back into ``module.load_state_dict`` (strict), ``verify_plan``'s advice for a plain
colwise fused qkv, the error of an attention that reads the full width from its
input; and (issue 49) an id outside the vocabulary raising through a
vocabulary-parallel embedding as through ``nn.Embedding``."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import functp
from functp import P

V, C, NH, L, T = 32, 16, 4, 2, 8


class Attention(nn.Module):
    """Causal self-attention with a fused ``[q; k; v]`` projection split by width;
    local sizes read from the tensors (what a tensor-parallel port needs)."""

    def __init__(self):
        super().__init__()
        self.n_embd, self.n_head = C, NH
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.register_buffer("bias", torch.ones(T, T).tril().view(1, 1, T, T))

    def forward(self, x):
        b, t, _ = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (z.view(b, t, -1, C // NH).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // NH)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, -1))


class FullWidthAttention(Attention):
    """The same attention as a single-device script writes it: the width ``C`` read
    from the (replicated, full-width) input, q/k/v split by ``n_embd``."""

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.n_head)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), attention(), nn.LayerNorm(C)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(C, 4 * C), c_proj=nn.Linear(4 * C, C)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(nn.functional.gelu(self.mlp.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, attention=Attention):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, C), wpe=nn.Embedding(T, C),
            h=nn.ModuleList(Block(attention) for _ in range(L)), ln_f=nn.LayerNorm(C)))
        self.lm_head = nn.Linear(C, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight        # tied

    def forward(self, idx):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _plan(qkv="packed_colwise_qkv"):
    return {"transformer.wte": "embedding_rowwise", "transformer.wpe": "replicated",
            "transformer.h.*.ln_*": "replicated", "transformer.h.*.attn.c_attn": qkv,
            "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise", "transformer.ln_f": "replicated",
            "lm_head": "colwise_gather_output"}


def _gpt(attention=Attention):
    torch.manual_seed(0)                       # the same weights on every rank
    return GPT(attention).double()


def _tied_hf():
    import _hf
    return _hf._build("llama", tie_word_embeddings=True)


_MESHES = {"tp2": ((2,), ("tp",)), "dp2_tp2": ((2, 2), ("dp", "tp"))}


def _laid_out(which: str, mesh_name: str):
    model = _gpt() if which == "gpt" else _tied_hf()
    mesh = functp.make_mesh(*_MESHES[mesh_name])
    plan = _plan() if which == "gpt" else "auto"
    apply, params, specs = functp.parallelize(model, mesh, plan)
    # "trained" blocks: parameter number i moved by (i + 1) / 64 on every rank alike
    shift = {k: (i + 1) / 64 for i, k in enumerate(params)}
    trained = {k: v + shift[k] for k, v in params.items()}
    return model, mesh, apply, trained, specs, shift


def _check_round_trip(model, sd, shift, what):
    """``sd`` loads strictly into a copy of ``model`` and gives it the trained values:
    the module's own moved by ``shift`` (a tied name by its parameter's), buffers kept."""
    want = model.state_dict()
    assert list(sd) == list(want), f"{what}: keys {list(sd)} vs module.state_dict() {list(want)}"
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(sd, strict=True)
    first = {id(p): n for n, p in model.named_parameters()}
    names = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    for k, v in fresh.state_dict().items():
        expected = want[k] + shift[names[k]] if k in names else want[k]
        torch.testing.assert_close(v, expected, rtol=0, atol=1e-15,
                                   msg=lambda m: f"{what} {k}: {m}")
    for alias, name in names.items():       # a tied name is the same full tensor
        assert sd[alias] is sd[name], f"{what}: {alias} is not {name}'s tensor"
    return sorted(k for k in names if names[k] != k)


def _apply_state_dict(which, mesh_name):
    model, mesh, apply, trained, specs, shift = _laid_out(which, mesh_name)
    return _check_round_trip(model, apply.state_dict(trained), shift, "apply.state_dict")


def _full_state_dict(which, mesh_name):
    model, mesh, apply, trained, specs, shift = _laid_out(which, mesh_name)
    sd = functp.full_state_dict(trained, mesh, specs, module=model)
    if functp.process_index() != 0:
        assert sd is None
        return None
    return _check_round_trip(model, sd, shift, "full_state_dict")


_CASES = [(w, m) for w in ("gpt", "hf") for m in _MESHES]


@pytest.mark.parametrize("which,mesh_name", _CASES, ids=[f"{w}-{m}" for w, m in _CASES])
def test_apply_state_dict_round_trips_strictly_with_tied_keys(run, which, mesh_name):
    if which == "hf":
        pytest.importorskip("transformers")
    world = math.prod(_MESHES[mesh_name][0])
    tied = run(world, _apply_state_dict, which, mesh_name)
    assert tied[0] == ["lm_head.weight"]          # (the name a tied parameter lacks)


@pytest.mark.parametrize("which,mesh_name", _CASES, ids=[f"{w}-{m}" for w, m in _CASES])
def test_full_state_dict_with_module_round_trips_strictly_with_tied_keys(run, which, mesh_name):
    if which == "hf":
        pytest.importorskip("transformers")
    world = math.prod(_MESHES[mesh_name][0])
    tied = run(world, _full_state_dict, which, mesh_name, gloo=True)
    assert tied[0] == ["lm_head.weight"] and tied[1:] == [None] * (world - 1)


def _incomplete():
    model, mesh, apply, trained, specs, shift = _laid_out("gpt", "tp2")
    trained.pop("transformer.h.0.attn.c_attn.bias")
    with pytest.raises(functp.ShardingError, match="missing.*c_attn.bias"):
        apply.state_dict(trained)


def test_state_dict_of_blocks_missing_a_parameter_names_it(run):
    run(2, _incomplete)


# -- verify_plan on a plain 'colwise' fused qkv; a full width read from the input ------------

def _verify(attention, qkv):
    model = _gpt(attention)
    mesh = functp.make_mesh((2,), ("tp",))
    ids = torch.randint(V, (2, T), generator=torch.Generator().manual_seed(0))
    try:
        return functp.verify_plan(model, mesh, _plan(qkv), ids)
    except functp.ShardingError as e:
        return str(e)


def test_verify_plan_names_the_fused_qkv_split_plainly_and_suggests_packed(run):
    message = run(2, _verify, Attention, "colwise")[0]
    assert isinstance(message, str), f"a plain colwise fused qkv passed verify_plan: {message}"
    first = "the first module whose output differs under the plan is 'transformer.h.0.attn.c_proj'"
    assert first in message, message
    # the cause: the parent's code splits the plainly split c_attn output by width
    assert "its input already differs" in message and "'transformer.h.0.attn'" in message, message
    assert "'transformer.h.0.attn.c_attn'" in message and "Colwise(packed=3)" in message, message
    assert "packed_colwise_qkv" in message, message
    # the fix it names passes
    report = run(2, _verify, Attention, "packed_colwise_qkv")[0]
    assert isinstance(report, dict) and report["max_error"] < 1e-12, report


def test_full_width_read_from_the_input_names_local_sizes(run):
    message = run(2, _verify, FullWidthAttention, "packed_colwise_qkv")[0]
    assert isinstance(message, str), message
    assert "module 'transformer.h.0.attn' (FullWidthAttention) raised" in message, message
    assert "x.size()" in message and "functp.LocalSizes('n_embd', 'n_head')" in message, message


# -- an id outside the vocabulary through a vocabulary-parallel embedding (issue 49) ---------

class _Embedded(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, C), nn.Linear(C, 3)

    def forward(self, ids):
        return self.out(self.emb(ids))


def _outside(transform: str, tp: int):
    torch.manual_seed(0)
    model = _Embedded().double()
    mesh = functp.make_mesh((tp,), ("tp",))
    apply, params, specs = functp.parallelize(model, mesh, {"emb": "embedding_rowwise",
                                                            "out": "replicated"})
    loss = functp.shard_map(lambda p, i: apply(p, i).square().sum(), mesh,
                            in_specs=(specs, P()), out_specs=P())
    step = torch.func.grad(loss) if transform == "grad" else loss
    ref_apply, full = functp.functionalize(model)
    ref = lambda p, i: ref_apply(p, i).square().sum()
    ref_step = torch.func.grad(ref) if transform == "grad" else ref
    good = torch.tensor([[0, V - 1, 5], [7, 1, V // 2]])
    for _ in range(2):              # the first call records, the second replays
        got = step(params, good)
        if transform == "grad":
            got = apply.unshard(got)
        torch.testing.assert_close(got, ref_step(full, good), rtol=1e-12, atol=1e-12)
    errors = []
    for bad in (torch.tensor([[0, V, 5]]), torch.tensor([[-1, 2, 3]])):
        with pytest.raises((RuntimeError, IndexError)) as e:
            step(params, bad)           # (a replayed call)
        errors.append(str(e.value))
        with pytest.raises(IndexError):
            ref_step(full, bad)         # as the unsharded model
    return errors, apply.replay_status()


@pytest.mark.parametrize("transform", ["forward", "grad"])
@pytest.mark.parametrize("tp", [2, 1])
def test_an_id_outside_the_vocabulary_raises_through_the_vocabulary_parallel_embedding(
        run, transform, tp):
    for errors, status in run(tp, _outside, transform, tp):
        assert status == ["replayed"], status
        for e in errors:
            assert f"outside the vocabulary [0, {V})" in e and "'emb'" in e, e


def _verify_hf_gpt2_plain_qkv():
    import warnings
    import _hf
    from functp.parallel._hf import _auto_plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # transformers' notes about tiny configs
        model = _hf._build("gpt2")
    # the shipped plan but for c_attn, split plainly
    plan = {k: ("colwise" if k.endswith("c_attn") else v) for k, v in _auto_plan(model).items()}
    with pytest.raises(functp.ShardingError) as e:
        functp.verify_plan(model, functp.make_mesh((2,), ("tp",)), plan)
    return str(e.value)


def test_verify_plan_suggests_packed_for_transformers_gpt2_plain_qkv(run):
    pytest.importorskip("transformers")
    message = run(2, _verify_hf_gpt2_plain_qkv)[0]
    assert "'transformer.h.0.attn.c_attn'" in message and "Colwise(packed=3)" in message, message


def _outside_compiled():
    import torch._dynamo
    torch.manual_seed(0)
    model = _Embedded().double()
    mesh = functp.make_mesh((2,), ("tp",))
    apply, params, specs = functp.parallelize(model, mesh, {"emb": "embedding_rowwise",
                                                            "out": "replicated"})
    loss = functp.shard_map(lambda p, i: apply(p, i).square().sum(), mesh,
                            in_specs=(specs, P()), out_specs=P())
    torch._dynamo.reset()
    step = torch.compile(torch.func.grad(loss), fullgraph=True, backend="aot_eager")
    good = torch.tensor([[0, V - 1, 5]])
    ref_apply, full = functp.functionalize(model)
    want = torch.func.grad(lambda p, i: ref_apply(p, i).square().sum())(full, good)
    torch.testing.assert_close(apply.unshard(step(params, good)), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match=r"outside the vocabulary \[0, 32\)"):
        step(params, torch.tensor([[0, V, 5]]))       # the check is in the compiled graph
    return True


def test_an_id_outside_the_vocabulary_raises_in_a_compiled_step(run):
    assert all(run(2, _outside_compiled, gloo=True, timeout=600))
