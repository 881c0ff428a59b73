"""FSDP gathers a group of modules at once: one all-gather of one flat buffer per dtype,
and one reduce-scatter of the group's gradients (FSDP2's units, issue 36).

Checked against the unsharded model (float64, and a float32 parameter held in a
float64 model: two dtypes, two flat buffers per group), through ``torch.func.grad``
and tape autograd, on 2, 4 and 8 ranks and on HSDP's 2-d meshes, with the
collectives of each step counted."""
from __future__ import annotations

import pytest
import torch

import functp
from functp import FullyShard, P
from _oracle import grads_and_loss


class _Block(torch.nn.Module):
    """A layer: two linears and a scale kept in float32 (a second dtype)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16, dtype=torch.float32))

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x))) * self.scale.double()


class _Model(torch.nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(layers))
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _case(shape, names, tape, groups=None, free=False):
    """One step of the model under FullyShard (HSDP over ``dp_replicate`` when the mesh
    has it; ``free``: each module frees its gathered weights after the forward): its
    error against the unsharded model, the step's collectives, and those of the tape
    backward alone (all-gathers: count, bytes)."""
    mesh = functp.make_mesh(shape, names)
    torch.manual_seed(0)
    model = _Model()
    model.embed.double(), model.head.double()
    for b in model.blocks:
        b.up.double(), b.down.double()
    replicate = ("dp_replicate",) if "dp_replicate" in names else ()
    style = FullyShard(mesh.axis_size("fsdp"), replicate, free=free,
                       **({} if groups is None else {"groups": groups}))
    apply, params, specs = functp.parallelize(model, mesh, {"fsdp": style})
    batch = apply.batch_axes
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    step = functp.shard_map(lambda p, x: functp.pmean(apply(p, x).square().mean(), batch),
                            mesh, in_specs=(specs, P(batch)), out_specs=P())
    xs = functp.shard(x, mesh, P(batch))
    step(params, xs)                # (the first call checks the order; the next prefetches)
    with functp.comm_log() as log:
        if tape:
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            loss = step(p, xs)
            with functp.comm_log() as bwd:
                loss.backward()
            grads = {k: v.grad for k, v in p.items()}
            backward = (bwd.summary().get(("all_gather", ("fsdp",)), 0),
                        bwd.nbytes("all_gather", ("fsdp",)))
        else:
            grads, loss = grads_and_loss(step, params, xs, tape=tape)
            backward = None
    ref_apply, full = functp.functionalize(model)
    ref, ref_loss = torch.func.grad_and_value(lambda p: ref_apply(p, x).square().mean())(full)
    got = apply.unshard(grads)
    # float32 gradients summed in another order: their own rounding
    err = max(((got[k] - v).abs().max() / v.abs().max()).item()
              / (1e-5 if v.dtype == torch.float32 else 1e-10) for k, v in ref.items())
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    return (abs(loss.item() - ref_loss.item()), err, log.summary(),
            log.nbytes("all_reduce", ("dp_replicate",)), shapes, dict(specs), backward)


_MESHES = {"fsdp2": ((2,), ("fsdp",)), "fsdp4": ((4,), ("fsdp",)), "fsdp8": ((8,), ("fsdp",)),
           "replicate2_fsdp2": ((2, 2), ("dp_replicate", "fsdp")),
           "replicate2_fsdp4": ((2, 4), ("dp_replicate", "fsdp"))}


@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
@pytest.mark.parametrize("mesh_name", list(_MESHES))
def test_one_gather_and_one_reduce_scatter_per_group_and_dtype(run, mesh_name, tape):
    shape, names = _MESHES[mesh_name]
    world = shape[0] * (shape[1] if len(shape) > 1 else 1)
    loss_err, err, log, hsdp_bytes, shapes, specs, _ = run(world, _case, shape, names, tape)[0]
    assert loss_err < 1e-12 and err < 1, (loss_err, err)
    # groups: each of the 3 blocks (float64 linears + a float32 scale: 2 flat buffers),
    # and the root's (embed and head, float64): 3 x 2 + 1 = 7, where a collective per
    # parameter would be 3 x 5 + 4 = 19
    assert log[("all_gather", ("fsdp",))] == 7 == log[("reduce_scatter", ("fsdp",))], log
    # what the user sees is each parameter's own block, as before
    fsdp = shape[-1]
    assert shapes["blocks.0.up.weight"] == (32 // fsdp, 16)
    assert shapes["blocks.1.scale"] == (16 // fsdp,) and specs["head.bias"] == P("fsdp")
    if "dp_replicate" in names:     # HSDP: the blocks' gradients summed over the replicas
        block_bytes = sum(8 * torch.Size(s).numel() for k, s in shapes.items()
                          if not k.endswith("scale")) + sum(
            4 * torch.Size(s).numel() for k, s in shapes.items() if k.endswith("scale"))
        assert hsdp_bytes == block_bytes
    else:
        assert hsdp_bytes == 0


@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
@pytest.mark.parametrize("mesh_name", ["fsdp2", "fsdp4", "replicate2_fsdp2"])
def test_free_full_weight_gathers_each_group_again_at_once(run, mesh_name, tape):
    # free_full_weight under tape: the backward gathers a group's freed weights again
    # with one all-gather (of one flat buffer) at the first unpack of any of them, as
    # FSDP2's pre-backward gathers a unit, not one per weight; torch.func keeps them
    shape, names = _MESHES[mesh_name]
    world = shape[0] * (shape[1] if len(shape) > 1 else 1)
    got = run(world, _case, shape, names, tape, None, True)[0]
    kept = run(world, _case, shape, names, tape)[0]
    loss_err, err, log, hsdp_bytes, shapes, _, backward = got
    assert loss_err < 1e-12 and err < 1, (loss_err, err)
    assert log[("reduce_scatter", ("fsdp",))] == 7 and hsdp_bytes == kept[3]
    if not tape:
        assert log == kept[2] and backward is None
        return
    # what the backward reads of the gathered weights: each block's up and down
    # weights (one float64 buffer; the float32 scale is read through its cast) and
    # the head's (the embedding's input needs no gradient): 3 + 1 gathers, where one
    # per weight would be 3 x 2 + 1 = 7; the bytes are those blocks', nothing more
    saved = [k for k in shapes if k.endswith(("up.weight", "down.weight"))] + ["head.weight"]
    assert backward == (4, sum(8 * torch.Size(shapes[k]).numel() for k in saved)), backward
    assert log[("all_gather", ("fsdp",))] == 7 + 4


@pytest.mark.parametrize("groups,gathers", [("module", 3 * 3 + 2), (["blocks"], 2 + 1)],
                         ids=["module", "patterns"])
def test_groups_chooses_the_units(run, groups, gathers):
    # "module": each module its own group (a block's scale belongs to the block itself:
    # 3 groups a block); ["blocks"]: the ModuleList is the unit, so every block in it
    # is one group (two dtypes) and the rest the root's
    loss_err, err, log, *_ = run(2, _case, (2,), ("fsdp",), False, groups)[0]
    assert loss_err < 1e-12 and err < 1
    assert log[("all_gather", ("fsdp",))] == gathers == log[("reduce_scatter", ("fsdp",))]


@pytest.mark.parametrize("groups", ["layers", [1], {"a": "b"}])
def test_a_bad_groups_argument_is_refused(groups):
    with pytest.raises(functp.ShardingError, match="groups must be None"):
        FullyShard(2, groups=groups)


def _grouped_step(n, tape, free):
    """Two steps of the model under FullyShard on ``n`` ranks (the first checks the
    order, the second prefetches; ``free``: free_full_weight under tape)."""
    mesh = functp.make_mesh((n,), ("fsdp",))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)     # (estimate: no .double() of a fake module)
    try:
        model = _Model()                       # (each block's scale in float32)
    finally:
        torch.set_default_dtype(default)
    apply, params, specs = functp.parallelize(model, mesh, {"fsdp": FullyShard(n, free=free)})
    x = torch.randn(16, 8, dtype=torch.float64)
    step = functp.shard_map(lambda p, x: functp.pmean(apply(p, x).square().mean(), "fsdp"),
                            mesh, in_specs=(specs, P("fsdp")), out_specs=P())
    xs = functp.shard(x, mesh, P("fsdp"))
    for _ in range(2):
        grads_and_loss(step, params, xs, tape=tape)


def _counted(n, tape, free):
    with functp.comm_log() as log:
        _grouped_step(n, tape, free)
    return {k: (c, log.nbytes(*k)) for k, c in log.summary().items()}


@pytest.mark.parametrize("tape,free", [(False, False), (True, True)],
                         ids=["func_grad", "tape_free"])
def test_the_estimate_counts_the_grouped_collectives(run, tape, free):
    # functp.estimate traces the same program on fake tensors: its gathers and
    # reduce-scatters (counts and bytes) are the real run's, one per group and dtype,
    # and under free_full_weight the backward's one regather per group
    real = run(4, _counted, 4, tape, free)[0]
    est = functp.estimate(_grouped_step, 4, 4, tape, free).comm
    got = {k: (c, est.nbytes(*k)) for k, c in est.summary().items()}
    assert got == real, (got, real)
    # (per step) 3 blocks of two dtypes and the root's group: 7 gathers and 7
    # reduce-scatters, and under free 4 regathers (each block's up and down weights,
    # the head's)
    assert real[("all_gather", ("fsdp",))][0] == 2 * (7 + 4 * free)
    assert real[("reduce_scatter", ("fsdp",))][0] == 2 * 7


class _Tail(torch.nn.Module):
    """A transformers-shaped model: an embedding, layers, the final norm and an LM
    head (``tied``: the head's weight is the embedding's, as transformers marks it)."""

    def __init__(self, tied=False):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight
            self.all_tied_weights_keys = {"head.weight": "embed.weight"}

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


_TAIL_PLAN = {"embed": "free_full_weight", "blocks.*": "free_full_weight",
              "norm": "keep_full_weight", "head": "keep_full_weight"}


def _tail_case(tied, tape):
    from _fsdp import _groups
    mesh = functp.make_mesh((2,), ("fsdp",))
    torch.manual_seed(0)
    model = _Tail(tied).double()
    for blk in model.blocks:            # (each block's scale in float32: two dtypes)
        blk.scale.data = blk.scale.data.float()
    style = FullyShard(2, free=_TAIL_PLAN)
    apply, params, specs = functp.parallelize(model, mesh, {"fsdp": style})
    ids = torch.randint(32, (8, 5), generator=torch.Generator().manual_seed(1))
    step = functp.shard_map(lambda p, i: functp.pmean(apply(p, i).square().mean(), "fsdp"),
                            mesh, in_specs=(specs, P("fsdp")), out_specs=P())
    local = functp.shard(ids, mesh, P("fsdp"))
    functp.set_overlap(first_bucket_mb=0.01)   # (the reduce-scatters deferred to the entry)
    step(params, local)            # (the first call checks the order)
    with functp.comm_log() as log:
        grads, loss = grads_and_loss(step, params, local, tape=tape)
    ref_apply, full = functp.functionalize(model)
    ref, ref_loss = torch.func.grad_and_value(lambda p: ref_apply(p, ids).square().mean())(full)
    got = apply.unshard(grads)
    err = max(((got[k] - v).abs().max() / v.abs().max()).item()
              / (1e-5 if v.dtype == torch.float32 else 1e-10) for k, v in ref.items())
    # the oracle's groups, and the flat buffers they make (one per group and dtype)
    oracle = _groups(model, specs, _TAIL_PLAN)
    buffers = {(g, p.dtype) for m, g in oracle.items()
               for p in model.get_submodule(m).parameters(recurse=False)}
    return (abs(loss.item() - ref_loss.item()), err, log.summary(), style.plan_groups(model),
            oracle, len(buffers))


@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_kept_norm_and_head_are_one_group_as_transformers_wraps_them(run, tied, tape):
    # transformers' FSDP2 wrapping: each module its fsdp_plan names is a fully_shard
    # unit, but the kept (final norm, LM head) pair is one; a tied head's rule moves to
    # the embedding, so the pair is (norm, embedding) and the head gathers with it
    loss_err, err, log, groups, oracle, buffers = run(2, _tail_case, tied, tape)[0]
    assert loss_err < 1e-12 and err < 1, (loss_err, err)
    parts = [{frozenset(m for m in g if g[m] == k) for k in g.values()} for g in (groups, oracle)]
    assert parts[0] == parts[1], (groups, oracle)          # (the oracle names its own)
    tail = "embed+norm" if tied else "norm+head"
    assert groups["norm"] == groups["head"] == tail
    assert groups["embed"] == ("embed+norm" if tied else "embed")
    assert log[("reduce_scatter", ("fsdp",))] == buffers
    # (tape: the freed layers' weights are gathered again in the backward)
    assert (log[("all_gather", ("fsdp",))] == buffers) != tape


def _in_flight_step(events, tape):
    """A 4-layer step, each layer its own group, that records each layer's backward."""
    mesh = functp.make_mesh((2,), ("fsdp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).double()
    def mark(module, args, out, i):         # (a forward hook's result would replace out)
        out.register_hook(lambda ct: events.append((functp.process_index(), "backward", i)))
    for i, layer in enumerate(model):
        layer.register_forward_hook(lambda m, a, out, i=i: mark(m, a, out, i))
    apply, params, specs = functp.parallelize(model, mesh,
                                              {"fsdp": FullyShard(2, groups=["*"])})
    step = functp.shard_map(lambda p, x: functp.pmean(apply(p, x).square().mean(), "fsdp"),
                            mesh, in_specs=(specs, P("fsdp")), out_specs=P())
    x = torch.randn(8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    functp.set_overlap(first_bucket_mb=0.01)     # (this rank's: the body is 66 KB)
    grads, _ = grads_and_loss(step, params, functp.shard(x, mesh, P("fsdp")), tape=tape)
    ref_apply, full = functp.functionalize(model)
    ref = torch.func.grad(lambda p: ref_apply(p, x).square().mean())(full)
    got = apply.unshard(grads)
    return max(((got[k] - v).abs().max() / v.abs().max()).item() for k, v in ref.items())


@pytest.mark.parametrize("tape", [False, True], ids=["func_grad", "tape"])
def test_a_groups_reduce_scatter_is_in_flight_during_the_rest_of_the_backward(
        monkeypatch, tape):
    # as a gather per weight's was (docs/overlap.md): launched where the group's
    # gather node runs, waited on at the body's entry, after the earlier layers'
    # backward; each layer's piece of the result added to its blocks' gradients
    from functp.ops import _primitives as prim
    events, record, wait = [], prim._record, prim._wait

    def launched(op, g, x, how="", ragged=False):
        if op == "reduce_scatter":
            events.append((functp.process_index(), "launch"))
        return record(op, g, x, how, ragged)

    def waited(t, op, g):
        if op == "reduce_scatter":
            events.append((functp.process_index(), "wait"))
        return wait(t, op, g)

    monkeypatch.setattr(prim, "_record", launched)
    monkeypatch.setattr(prim, "_wait", waited)
    errs = functp.simulate(_in_flight_step, 2, events, tape, check=False)
    assert max(errs) < 1e-12, errs
    r = events[0][0]
    mine = [e[1:] for e in events if e[0] == r]
    # the last layer's reduce-scatter launched before layer 0's backward, and no
    # wait before it: four launches, then the waits at the entry
    assert mine.index(("launch",)) < mine.index(("backward", 0)) < mine.index(("wait",)), mine
    assert mine.count(("launch",)) == 4 == mine.count(("wait",)), mine
