"""Expert-parallel MoE layer step: the ragged dispatch (``functp.ExpertDispatch()``,
exact traffic) against the padded one (``dispatch="padded"``, every block the worst
case), the ragged one with a capacity factor of 1.0 (also padded to capacity), on
gloo processes; then one transformers MoE model (a 1-layer Qwen3-MoE of the same
sizes) under ``DistributedConfig(ep_size=4, fsdp_size=4)``, through functp's
``parallelize(model, distributed_config=...)`` and through transformers' own
``from_pretrained(..., distributed_config=...)`` (its ``ep_plan``, all-to-all
dispatch and FSDP2; needs ``accelerate``: without it the error is recorded).

    python benchmarks/moe.py                 # 4 local gloo processes (ep=4)
    python benchmarks/moe.py --steps 20

Per variant, on rank 0: bytes this rank sends per step by collective (``comm_log``;
for transformers, the input tensors of the c10d ops a dispatch mode sees), the
collective counts, the median step time, and the ratios padded / ragged. Writes
results/moe.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _run import main_or_launch, save_and_leave  # noqa: E402

import functp  # noqa: E402
from functp import P  # noqa: E402
from functp.models.llama import LlamaConfig, LlamaMoE  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 128, 256, 8, 2, 512     # TOKENS per rank


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = LlamaMoE(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                        num_experts=EXPERTS, num_experts_per_tok=TOP_K))

    def forward(self, x):
        return x + self.moe(x)


VARIANTS = {"ragged": dict(), "padded": dict(dispatch="padded"),
            "ragged_cf1.0": dict(capacity_factor=1.0),
            "cf1.0_pad_to_capacity": dict(capacity_factor=1.0, pad_to_capacity=True)}


def _measure(name: str, mesh, steps: int) -> dict:
    torch.manual_seed(0)
    dispatch = functp.ExpertDispatch(**VARIANTS[name])
    plan = {"moe.router": "replicated", "moe.experts": dispatch}
    apply, params, specs = functp.parallelize(Layer(), mesh, plan, axis="ep")
    n = mesh.shape["ep"]
    x = torch.randn(n * TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    xl = functp.shard(x, mesh, P("ep"))
    step = functp.shard_map(lambda p, xb: functp.pmean((apply(p, xb) ** 2).mean(), "ep"),
                            mesh, in_specs=(specs, P("ep")), out_specs=P())
    grad = torch.func.grad(step)
    with functp.comm_log() as log:
        grad(params, xl)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        grad(params, xl)
        times.append(time.perf_counter() - t0)
    ops = sorted({e.op for e in log.events})
    return {"bytes": {op: log.nbytes(op) for op in ops},
            "bytes_total": log.nbytes(),
            "collectives": {op: log.count(op) for op in ops},
            "step_ms_median": 1e3 * statistics.median(times),
            "dropped_pairs_rank0": dispatch.dropped.get("moe.experts", 0),
            "routed_pairs_rank0": TOKENS * TOP_K}


def _qwen3_moe_checkpoint() -> str:
    """A 1-layer Qwen3-MoE of the layer's sizes, saved by rank 0 (float32)."""
    import tempfile
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    path = [tempfile.mkdtemp(prefix="functp_moe_") if functp.process_index() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if functp.process_index() == 0:
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER,
            moe_intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K)).save_pretrained(path[0])
    dist.barrier()
    return path[0]


class _C10dBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the c10d collectives a step issues and the bytes of their inputs (the
    send side, as comm_log counts functp's)."""
    SEND_ARG = {"_allgather_base_": 1, "_reduce_scatter_base_": 1, "alltoall_base_": 1,
                "all_to_all_single": 0, "allreduce_": 0, "all_reduce": 0}

    def __init__(self):
        super().__init__()
        self.counts, self.bytes = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if "c10d" in func.namespace and name in self.SEND_ARG:
            sent = args[self.SEND_ARG[name]]
            sent = sent if isinstance(sent, (list, tuple)) else [sent]
            self.counts[name] = self.counts.get(name, 0) + 1
            self.bytes[name] = self.bytes.get(name, 0) + sum(t.numel() * t.element_size()
                                                             for t in sent)
        return func(*args, **(kwargs or {}))


def _hf_steps(step, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def _hf_functp(path: str, config, ids, steps: int) -> dict:
    """The model under functp's parallelize(distributed_config=...), one tape step."""
    from transformers import Qwen3MoeForCausalLM
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply, params, specs = functp.parallelize(model, distributed_config=config)
    batch = apply.batch_axes
    loss = functp.shard_map(
        lambda p, i: functp.pmean(apply(p, input_ids=i, labels=i, use_cache=False).loss, batch),
        apply.mesh, in_specs=(specs, P(batch)), out_specs=P())
    p = {k: v.detach().requires_grad_() for k, v in params.items()}
    ids = functp.shard(ids, apply.mesh, P(batch))

    def step():
        loss(p, ids).backward()
    with functp.comm_log() as log:
        step()
    times = _hf_steps(step, steps)
    ops = sorted({e.op for e in log.events})
    return {"bytes": {op: log.nbytes(op) for op in ops}, "bytes_total": log.nbytes(),
            "collectives": {op: log.count(op) for op in ops},
            "step_ms_median": 1e3 * statistics.median(times)}


def _hf_transformers(path: str, config, ids, steps: int) -> dict:
    """The model under transformers' own distributed_config path, one tape step."""
    from transformers import Qwen3MoeForCausalLM
    model = Qwen3MoeForCausalLM.from_pretrained(path, distributed_config=config,
                                                dtype=torch.float32)
    mine = ids.chunk(functp.process_count())[functp.process_index()]

    def step():
        model(input_ids=mine, labels=mine).loss.backward()
    with _C10dBytes() as seen:
        step()
    times = _hf_steps(step, steps)
    return {"bytes": seen.bytes, "bytes_total": sum(seen.bytes.values()),
            "collectives": seen.counts, "step_ms_median": 1e3 * statistics.median(times)}


def _hf_rows(steps: int, transformers_first: bool = False) -> dict:
    """functp and transformers' own EP on one transformers MoE model and config."""
    import warnings
    from transformers import DistributedConfig
    warnings.simplefilter("ignore")
    path = _qwen3_moe_checkpoint()
    n = functp.process_count()
    config = DistributedConfig(ep_size=n, fsdp_size=n)
    ids = torch.randint(0, 256, (n, TOKENS), generator=torch.Generator().manual_seed(1))
    out = {"config": f"Qwen3-MoE, 1 layer, DistributedConfig(ep_size={n}, fsdp_size={n})"}
    try:
        if not transformers_first:
            out["functp"] = _hf_functp(path, config, ids, steps)
        try:
            out["transformers"] = _hf_transformers(path, config, ids, steps)
        except Exception as e:      # recorded, not raised: the row says why it is missing
            out["transformers"] = {"error": f"{type(e).__name__}: {e}"}
        if transformers_first:      # (the other order: a warm-up or cache effect shows)
            out["functp"] = _hf_functp(path, config, ids, steps)
    finally:
        import shutil
        import torch.distributed as dist
        dist.barrier()
        if functp.process_index() == 0:
            shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--transformers-first", action="store_true",
                    help="run transformers' EP step before functp's (both orders)")
    ap.add_argument("--model-only", action="store_true",
                    help="only the transformers model's rows (functp and transformers)")
    args = ap.parse_args()
    mesh = functp.make_mesh((functp.process_count(),), ("ep",))
    res = {"config": dict(hidden=HIDDEN, intermediate=INTER, experts=EXPERTS, top_k=TOP_K,
                          tokens_per_rank=TOKENS, ranks=mesh.shape["ep"], steps=args.steps,
                          dtype="float32", torch=torch.__version__)}
    if not args.model_only:
        _variants(res, mesh, args.steps)
    res["transformers_model"] = hf = _hf_rows(args.steps, args.transformers_first)
    if functp.process_index() == 0:
        print(hf["config"])
        for name in ("functp", "transformers"):
            r = hf[name]
            print(f"{name:14s} " + (r["error"] if "error" in r else
                  f"bytes {r['bytes_total']:>10,}  {r['collectives']}  "
                  f"median {r['step_ms_median']:.1f} ms"))
    save_and_leave("moe", res)


def _variants(res: dict, mesh, steps: int) -> None:
    """The MoE layer's dispatch variants (ragged, padded, capacity)."""
    for name in VARIANTS:
        res[name] = _measure(name, mesh, steps)
    res["padded_over_ragged"] = {
        "bytes": res["padded"]["bytes_total"] / res["ragged"]["bytes_total"],
        "step_time": res["padded"]["step_ms_median"] / res["ragged"]["step_ms_median"]}
    if functp.process_index() == 0:
        for name in VARIANTS:
            r = res[name]
            print(f"{name:14s} bytes {r['bytes_total']:>10,}  {r['collectives']}  "
                  f"median {r['step_ms_median']:.1f} ms  dropped {r['dropped_pairs_rank0']}")
        print("padded / ragged:", res["padded_over_ragged"])


if __name__ == "__main__":
    main_or_launch(main, 4, __file__, *sys.argv[1:])
