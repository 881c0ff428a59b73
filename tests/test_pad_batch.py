"""A data set's last batch that does not divide by dp (issue 50): ``functp.pad_batch``
pads it with a 0/1 weight per row, and the weighted mean over the weights' psum is the
unpadded batch's mean loss, its gradients the unsharded model's; the uneven batch's
error names it."""
from __future__ import annotations

import pytest
import torch

import functp
from functp import P, ShardingError


def _last_batch(n: int, rows: int, how: str):
    mesh = functp.make_mesh((n,), ("dp",))
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, 4, dtype=torch.float64, generator=g), torch.randn(rows, 3, dtype=torch.float64, generator=g)
    (xp, yp), weight = functp.pad_batch((x, y), mesh, "dp")

    def loss(w, x, y, m):
        row = ((x @ w - y) ** 2).mean(-1)
        return functp.psum((row * m).sum(), "dp") / functp.psum(m.sum(), "dp")
    step = functp.shard_map(loss, mesh, in_specs=(P(), P("dp"), P("dp"), P("dp")), out_specs=P())
    local = functp.shard((xp, yp, weight.double()), mesh, P("dp"))
    ref = torch.func.grad_and_value(lambda w: ((x @ w - y) ** 2).mean())(w)
    if how == "func.grad":
        got = torch.func.grad_and_value(step)(w, *local)
    else:
        leaf = w.clone().requires_grad_()
        value = step(leaf, *local)
        got = (torch.autograd.grad(value, leaf)[0], value)
    try:     # the same batch unpadded is refused, naming pad_batch
        functp.shard_map(loss, mesh, in_specs=(P(), P("dp"), P("dp"), P("dp")), out_specs=P())(
            w, *functp.shard((x, y, torch.ones(rows, dtype=torch.float64)), mesh, P("dp")))
        msg = "no error"
    except ShardingError as e:
        msg = str(e)
    return (float((got[0] - ref[0]).abs().max()), abs(float(got[1] - ref[1])),
            tuple(xp.shape), msg)


@pytest.mark.parametrize("how", ["tape", "func.grad"])
@pytest.mark.parametrize("n,rows", [(2, 5), (4, 7)])
def test_a_padded_last_batch_keeps_the_mean_exact(run, n, rows, how):
    for grad_err, loss_err, shape, msg in run(n, _last_batch, n, rows, how):
        assert grad_err <= 1e-12 and loss_err <= 1e-12, (grad_err, loss_err)
        assert shape[0] % n == 0 and shape[0] < rows + n, shape
        assert "functp.pad_batch" in msg, msg
