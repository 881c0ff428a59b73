"""What each attention strategy costs, as docs/long_sequences.md says: the bytes a
rank hands its collectives (comm_log, and functp.estimate's, which is comm_log on
fake tensors) follow the page's formulas, and the peak memory per rank at cp=4 is
within 30% of a quarter of the cp=1 run's (issue 53)."""
from __future__ import annotations

import math

import pytest
import torch

import functp
from functp import P

SPEC = P(None, None, "cp", None)


def formula(strategy, n, b, hq, hk, s, d, item):
    """(forward bytes, gradient-step bytes) of the page's table, without the loss's
    all-reduce; ``s`` this rank's tokens."""
    kv = 2 * b * hk * s * d * item
    if strategy == "allgather":
        return kv, kv + n * kv                # the gather, then the K/V grads' reduce-scatter
    if strategy == "ulysses":
        hk2 = hk if hk % n == 0 else math.lcm(hk, n)
        fwd = (2 * hq + 2 * hk2) * b * s * d * item
        return fwd, 2 * fwd
    return (n - 1) * kv, 2 * (n - 1) * kv


def _step(strategy, b, hq, hk, seq, d, dtype, grad=True):
    n = functp.process_count()
    mesh = functp.make_mesh((n,), ("cp",))
    q = functp.cp_shard(torch.randn(b, hq, seq, d, dtype=dtype), mesh, dim=2)
    k, v = (functp.cp_shard(torch.randn(b, hk, seq, d, dtype=dtype), mesh, dim=2)
            for _ in range(2))

    def attend(q, k, v):
        return functp.attention(q, k, v, "cp", strategy=strategy, causal=True)
    if not grad:
        return functp.shard_map(attend, mesh, in_specs=(SPEC,) * 3, out_specs=SPEC)(q, k, v)
    loss = functp.shard_map(lambda *t: functp.psum(attend(*t).square().sum(), "cp"), mesh,
                            in_specs=(SPEC,) * 3, out_specs=P())
    return torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _logged_body(cases):
    got = []
    for strategy, hq, hk in cases:
        shape = (2, hq, hk, 8 * functp.process_count(), 4, torch.float64)
        with functp.comm_log() as fwd:
            _step(strategy, *shape, grad=False)
        with functp.comm_log() as step:
            _step(strategy, *shape)
        got.append((fwd.nbytes(), step.nbytes() - step.nbytes("all_reduce"),
                    step.count("all_reduce")))
    return got


CASES = [(s, hq, hk) for s in ("allgather", "ulysses", "ring") for hq, hk in ((4, 4), (4, 1))]


@pytest.mark.parametrize("n", [2, 4])
def test_logged_bytes_are_the_formulas(run, n):
    got = run(n, _logged_body, CASES)[0]
    want = [formula(s, n, 2, hq, hk, 8, 4, 8) + (1,) for s, hq, hk in CASES]
    assert got == want, list(zip(CASES, got, want))


def test_estimate_bytes_and_peak_memory_per_rank():
    """At 1024 tokens (float32), each strategy's cp=4 peak is within 30% of a quarter
    of its cp=1 peak, and the estimate's bytes are the formula's."""
    rows = {}
    for strategy in ("allgather", "ulysses", "ring"):
        one = functp.estimate(_step, 1, strategy, 1, 8, 2, 1024, 16, torch.float32)
        four = functp.estimate(_step, 4, strategy, 1, 8, 2, 1024, 16, torch.float32)
        rows[strategy] = four.peak_bytes / (one.peak_bytes / 4)
        comm = four.comm.nbytes() - four.comm.nbytes("all_reduce")
        assert comm == formula(strategy, 4, 1, 8, 2, 256, 16, 4)[1], (strategy, comm)
    assert all(0.7 <= r <= 1.3 for r in rows.values()), rows


def _llama_cp_step(model, strategy, seq):
    """One torch.func.grad step of a transformers Llama parallelized over ``cp``."""
    from _hf import VOCAB
    mesh = functp.make_mesh((functp.process_count(),), ("cp",))
    apply, params, specs = functp.parallelize(model, mesh,
                                              {"cp": functp.ContextParallel(strategy)})
    ids = torch.randint(3, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    step = functp.shard_map(
        lambda p, i: functp.psum(apply(p, input_ids=i).logits.square().sum(), "cp"), mesh,
        in_specs=(specs, P()), out_specs=P())
    return torch.func.grad(step)(params, ids)


@pytest.mark.parametrize("strategy", ["allgather", "ulysses", "ring"])
def test_estimate_of_a_transformers_model_on_cp(strategy):
    """functp.estimate of a parallelized transformers Llama on cp=1, 2 and 4 at 512
    tokens: its attention's bytes are the page's formula once a layer (the parameters'
    gradient all-reduces aside), and the step's peak per rank at cp=4 (above what it
    holds before the step: the activations and temporaries) is within 30% of a quarter
    of cp=1's (issue 53; seen 0.28, 0.27, 0.24 for allgather, ulysses, ring)."""
    pytest.importorskip("transformers")
    import warnings
    from _hf import _build
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build("llama", attn_implementation="sdpa", max_position_embeddings=512)
    c = model.config
    peaks = {}
    for n in (1, 2, 4):
        est = functp.estimate(_llama_cp_step, n, model, strategy, 512)
        comm = est.comm.nbytes() - est.comm.nbytes("all_reduce")
        if n > 1:
            per_layer = formula(strategy, n, 1, c.num_attention_heads, c.num_key_value_heads,
                                512 // n, c.head_dim, 8)[1]
            assert comm == c.num_hidden_layers * per_layer, (n, comm, per_layer)
        peaks[n] = est.step_peak_bytes
    assert peaks[4] < peaks[2] < peaks[1], peaks
    assert 0.7 * peaks[1] / 4 <= peaks[4] <= 1.3 * peaks[1] / 4, (peaks[4] / peaks[1], peaks)
