"""functp.grad / value_and_grad: the gradients of torch.func.grad_and_value (and of the
unsharded float64 program), with tape autograd's memory at the top level and
torch.func's composition when nested."""
from __future__ import annotations

import pytest
import torch

import functp
from functp import P, ShardingError
from _oracle import LivePeak, randn


def _mlp(p, x):
    h = x
    for i in range(4):
        h = torch.tanh(h @ p[f"w{i}"])
    return h.square().mean()


def _dp_tp_program(argnums, has_aux):
    mesh = functp.make_mesh((2, 2), ("dp", "tp"))
    full = {"w1": randn(6, 8, seed=1), "w2": randn(8, 6, seed=2)}
    specs = {"w1": P(None, "tp"), "w2": P("tp", None)}
    x = randn(4, 6, seed=3)

    def loss(p, x):
        out = functp.psum(torch.tanh(x @ p["w1"]) @ p["w2"], "tp")
        v = functp.pmean(out.square().mean(), "dp")
        return (v, out.detach()) if has_aux else v

    step = functp.shard_map(loss, mesh, in_specs=(specs, P("dp")),
                            out_specs=(P(), P("dp")) if has_aux else P())
    local, xl = functp.shard(full, mesh, specs), functp.shard(x, mesh, P("dp"))
    ours = functp.value_and_grad(step, argnums, has_aux=has_aux)(local, xl)
    g, v = torch.func.grad_and_value(step, argnums, has_aux=has_aux)(local, xl)
    gp = ours[1][0] if isinstance(argnums, tuple) else ours[1]
    return ours[0], v, functp.unshard(gp, mesh, specs), \
        functp.unshard(g[0] if isinstance(argnums, tuple) else g, mesh, specs)


@pytest.mark.parametrize("argnums,has_aux", [(0, False), ((0, 1), False), (0, True)])
def test_value_and_grad_matches_torch_func_and_the_unsharded_program(argnums, has_aux):
    full = {"w1": randn(6, 8, seed=1), "w2": randn(8, 6, seed=2)}
    x = randn(4, 6, seed=3)
    want_g, want_v = torch.func.grad_and_value(
        lambda p: (torch.tanh(x @ p["w1"]) @ p["w2"]).square().mean())(full)
    for ours_v, func_v, ours_g, func_g in functp.simulate(_dp_tp_program, 4, argnums, has_aux):
        if has_aux:
            torch.testing.assert_close(ours_v[1], func_v[1])     # the aux output
            ours_v, func_v = ours_v[0], func_v[0]
        torch.testing.assert_close(ours_v, func_v)
        torch.testing.assert_close(ours_v, want_v)
        for k in full:
            torch.testing.assert_close(ours_g[k], func_g[k])
            torch.testing.assert_close(ours_g[k], want_g[k])


def test_nested_it_is_torch_func():
    # grad of grad and vmap of grad compose as torch.func's do
    p = {f"w{i}": randn(5, 5, seed=i) for i in range(4)}
    x = randn(3, 5, seed=9)
    inner = lambda w0: functp.grad(_mlp)({**p, "w0": w0}, x)["w1"].sum()
    want = lambda w0: torch.func.grad(_mlp)({**p, "w0": w0}, x)["w1"].sum()
    torch.testing.assert_close(torch.func.grad(inner)(p["w0"]), torch.func.grad(want)(p["w0"]))
    xs = randn(2, 3, 5, seed=10)
    torch.testing.assert_close(torch.vmap(lambda x: functp.grad(_mlp)(p, x)["w2"])(xs),
                               torch.vmap(lambda x: torch.func.grad(_mlp)(p, x)["w2"])(xs))


def test_top_level_uses_tape_memory():
    # torch.func.grad keeps its backward for higher derivatives (create_graph=True),
    # so every saved activation lives to the end; functp.grad at the top level does not
    p = {f"w{i}": randn(256, 256, seed=i).float() for i in range(4)}
    x = randn(64, 256, seed=9).float()
    peaks = {}
    for name, fn in [("functp", lambda: functp.grad(_mlp)(p, x)),
                     ("torch.func", lambda: torch.func.grad(_mlp)(p, x)),
                     ("tape", lambda: _tape_step(p, x))]:
        with LivePeak() as m:
            g = fn()
        del g
        peaks[name] = m.peak
    assert peaks["functp"] <= 1.05 * peaks["tape"], peaks
    assert peaks["torch.func"] > 1.2 * peaks["tape"], peaks     # what it saves


def _tape_step(p, x):
    leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
    return torch.autograd.grad(_mlp(leaves, x), list(leaves.values()))


def test_bad_inputs():
    p = {"w0": randn(3, 3, seed=1)}
    with pytest.raises(ShardingError, match="scalar tensor"):
        functp.grad(lambda p: p["w0"] * 2)(p)
    with pytest.raises(ShardingError, match="floating-point tensors only"):
        functp.grad(lambda p, n: p["w0"].sum() * n, argnums=1)(p, torch.tensor(3))
    with pytest.raises(ShardingError, match="argnums=2"):
        functp.grad(lambda p: p["w0"].sum(), argnums=2)(p)
    # an input that does not reach the value gets zeros, as torch.func.grad gives
    g = functp.grad(lambda a, b: a.sum(), argnums=(0, 1))(p["w0"], p["w0"] + 1)
    torch.testing.assert_close(g[1], torch.zeros(3, 3, dtype=p["w0"].dtype))
