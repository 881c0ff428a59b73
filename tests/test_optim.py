"""torch.optim over local blocks: the specs of an optimizer's state (derived from its
shape, or refused), the state a fresh optimizer needs before a load, and set_grads'
errors."""
from __future__ import annotations

import pytest
import torch

import functp
from functp import P, ShardingError

_OPTIMIZERS = [(torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adam, {}),
               (torch.optim.AdamW, {"weight_decay": 0.1}), (torch.optim.Adafactor, {}),
               (torch.optim.RMSprop, {})]


def _full():
    g = torch.Generator().manual_seed(0)
    return {"experts": torch.randn(4, 6, 4, generator=g),   # Adafactor: (4, 6, 1), (4, 1, 4)
            "bias": torch.randn(6, generator=g),             # Adafactor: one variance
            "w": torch.randn(6, 4, generator=g)}


def _full_grads():
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=g) for k, v in _full().items()}


_SPECS = {"experts": P("tp", None, None), "bias": P("tp"), "w": P()}


def _adafactor_body(path):
    """One Adafactor step on a tp=2 mesh, saved with optimizer_specs; loaded whole, the
    state is the unsharded run's (a state depends on the gradients only, and Adafactor
    factors the last two dimensions, which no spec here splits)."""
    ref = {k: v.clone().requires_grad_() for k, v in _full().items()}
    ref_opt = torch.optim.Adafactor(ref.values(), lr=1e-2)
    functp.set_grads(ref, _full_grads())
    ref_opt.step()

    mesh = functp.make_mesh((2,), ("tp",))
    local = {k: v.requires_grad_() for k, v in functp.shard(_full(), mesh, _SPECS).items()}
    opt = torch.optim.Adafactor(local.values(), lr=1e-2)
    functp.set_grads(local, functp.shard(_full_grads(), mesh, _SPECS))
    opt.step()
    specs = functp.optimizer_specs(opt, local, _SPECS)
    assert specs["state"][0] == {"step": P(), "row_var": P("tp", None, None),
                                 "col_var": P("tp", None, None)}, specs
    assert specs["state"][1] == {"step": P(), "variance": P("tp")}, specs
    functp.save(path, {"opt": opt.state_dict()}, mesh, {"opt": specs})
    got = functp.load(path)["opt"]["state"]              # whole, on this process alone
    want = ref_opt.state_dict()["state"]
    for i in want:
        assert got[i].keys() == want[i].keys(), (got[i].keys(), want[i].keys())
        for k in want[i]:
            assert torch.equal(got[i][k], want[i][k]), (i, k, got[i][k], want[i][k])


def test_adafactor_state_saved_sharded_loads_as_the_unsharded_runs(run, tmp_path):
    run(2, _adafactor_body, str(tmp_path / "ckpt"), gloo=True)


def _adafactor_refused_body():
    mesh = functp.make_mesh((2,), ("tp",))
    local = {"w": functp.shard(torch.ones(6, 4), mesh, P("tp", None)).requires_grad_()}
    opt = torch.optim.Adafactor(local.values())
    functp.set_grads(local, {"w": torch.ones(3, 4)})
    opt.step()
    with pytest.raises(ShardingError) as e:
        functp.optimizer_specs(opt, local, {"w": P("tp", None)})
    return str(e.value)


def test_adafactor_statistic_over_a_split_dimension_is_refused(run):
    msg = run(2, _adafactor_refused_body)[0]
    # col_var is the mean over the rows, which 'tp' splits: a statistic per rank
    for part in ("'col_var'", "'w'", "(1, 4)", "(3, 4)", "P('tp', None)", "dimension 0"):
        assert part in msg, msg


def test_state_of_a_replicated_parameter_is_replicated_whatever_its_shape():
    w = torch.ones(6, 4, requires_grad=True)
    opt = torch.optim.Adafactor([w])
    w.grad = torch.ones(6, 4)
    opt.step()
    assert functp.optimizer_specs(opt, {"w": w}, {"w": P()})["state"][0] == {
        "step": P(), "row_var": P(), "col_var": P()}


def test_parameters_without_state_are_left_out_as_in_state_dict():
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    opt = torch.optim.Adam([a, b])
    a.grad = torch.ones(3)              # b has no gradient: Adam makes no state for it
    opt.step()
    specs = functp.optimizer_specs(opt, {"a": a, "b": b}, {"a": P("tp"), "b": P("tp")})
    assert specs["state"].keys() == opt.state_dict()["state"].keys() == {0}, specs


@pytest.mark.parametrize("cls,kwargs", _OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
def test_init_optimizer_state_makes_a_steps_state_and_changes_nothing(cls, kwargs):
    stepped = {k: v.clone().requires_grad_() for k, v in _full().items()}
    fresh = {k: v.clone().requires_grad_() for k, v in _full().items()}
    opt = cls(stepped.values(), lr=0.1, **kwargs)
    functp.set_grads(stepped, _full_grads())
    opt.step()
    grad = torch.full((6,), 7.0)
    fresh["bias"].grad = grad
    new = cls(fresh.values(), lr=0.1, **kwargs)
    assert functp.init_optimizer_state(new) is new
    for k, v in _full().items():                         # parameters and .grad untouched
        assert torch.equal(fresh[k].detach(), v), k
    assert fresh["bias"].grad is grad and fresh["w"].grad is None
    assert new.param_groups[0]["lr"] == 0.1

    def layout(o):
        return {i: {k: (tuple(t.shape), t.dtype) if torch.is_tensor(t) else t
                    for k, t in s.items()} for i, s in o.state_dict()["state"].items()}
    assert layout(new) == layout(opt)
    want = functp.optimizer_specs(opt, stepped, _SPECS)
    assert functp.optimizer_specs(new, fresh, _SPECS) == want


def _resume_body(path):
    """AdamW stepped on (dp=2, tp=2), resumed on (dp=1, tp=4) in an optimizer built
    fresh there: its spec tree comes from init_optimizer_state + optimizer_specs."""
    specs = {"experts": P("tp", None, None), "bias": P(), "w": P(None, "tp")}
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    local = {k: v.requires_grad_() for k, v in functp.shard(_full(), mesh, specs).items()}
    opt = torch.optim.AdamW(local.values(), lr=1e-2)
    for _ in range(2):
        functp.set_grads(local, functp.shard(_full_grads(), mesh, specs))
        opt.step()
    functp.save(path, {"params": local, "opt": opt.state_dict()}, mesh,
                {"params": specs, "opt": functp.optimizer_specs(opt, local, specs)})
    saved = functp.unshard(opt.state_dict()["state"][2]["exp_avg_sq"], mesh, specs["w"])

    mesh4 = functp.make_mesh((1, 4), ("dp", "tp"))
    fresh = {k: v.requires_grad_() for k, v in functp.shard(_full(), mesh4, specs).items()}
    new = torch.optim.AdamW(fresh.values(), lr=1e-2)
    functp.init_optimizer_state(new)
    layout = {"params": specs, "opt": functp.optimizer_specs(new, fresh, specs)}
    state = functp.load(path, mesh4, layout)
    new.load_state_dict(state["opt"])
    got = functp.unshard(new.state_dict()["state"][2]["exp_avg_sq"], mesh4, specs["w"])
    return torch.equal(got, saved) and new.state_dict()["state"][2]["step"].item() == 2


def test_fresh_optimizer_loads_a_checkpoint_of_another_mesh(run, tmp_path):
    assert run(4, _resume_body, str(tmp_path / "ckpt"), gloo=True) == [True] * 4


def test_init_optimizer_state_refuses_lbfgs():
    with pytest.raises(ShardingError, match="LBFGS"):
        functp.init_optimizer_state(torch.optim.LBFGS([torch.ones(2, requires_grad=True)]))


def test_set_grads_names_a_none_or_nested_gradient_and_the_fix():
    p = {"w": torch.zeros(2, requires_grad=True), "b": torch.zeros(2, requires_grad=True)}
    with pytest.raises(ShardingError, match=r"gradient for 'b' is None.*zeros_like"):
        functp.set_grads(p, {"w": torch.ones(2), "b": None})
    with pytest.raises(ShardingError, match=r"gradient for 'b' is a dict.*flat dicts"):
        functp.set_grads(p, {"w": torch.ones(2), "b": {"x": torch.ones(2)}})
    with pytest.raises(ShardingError, match=r"params\['n'\] is a dict.*flat dict"):
        functp.set_grads({"n": {"x": torch.zeros(2)}}, {"n": {"x": torch.ones(2)}})
