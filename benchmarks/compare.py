"""functp against the PyTorch alternatives, layout by layout, in one run.

    python benchmarks/compare.py                  # 2 then 4 gloo processes, both sizes
    python benchmarks/compare.py --quick          # a smoke run: small size, few steps
    python benchmarks/compare.py --nproc 4 --layouts tp,sp --sizes medium --steps 30
    python benchmarks/compare.py --device cuda    # NCCL, one GPU per process

One training step (loss and gradients, no optimizer) of the same model (a stack of
pre-norm MLP blocks, benchmarks/_models.py) on the same data, in the same processes,
for every parallel layout (DP, FSDP, TP, SP, 2-D dp x tp) and every way of writing it:

- ``hand``: Megatron-style autograd.Functions around raw torch.distributed
  collectives (f/g operators, one bucketed gradient all-reduce after backward,
  all-gather/reduce-scatter Functions). The eager floor: every ratio is relative to it.
- functp: ``torch.func.grad`` of a shard_map'd loss with check_vma=True / False, the
  same through tape autograd, the TP plan API (``functp.parallelize``), and the tape
  step with the forward under ``torch.compile(fullgraph=True)``.
- PyTorch: DDP (DP), FSDP2 ``fully_shard`` (FSDP), DTensor ``parallelize_module``
  (TP; + SequenceParallel for SP; + DDP over dp for 2-D).
- ``unsharded``: the whole model on rank 0 alone (the other ranks wait).

Every variant is first checked in float64 against the unsharded model's loss and
gradients (the run aborts on a mismatch); the timing runs in float32. Steps of all
variants alternate (the order rotates every round) so that they see the same noise.
The script launches its own processes (torch.distributed.run), prints a table and
writes benchmarks/results/compare.json. See benchmarks/README.md for the columns.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import datetime
import json
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("dp", "fsdp", "tp", "sp", "2d")


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", default="2,4",
                    help="process counts to run, comma separated (2 and/or 4; default 2,4)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (default and minimum 2)")
    ap.add_argument("--sizes", default=None, help="comma separated: small,medium (default both)")
    ap.add_argument("--layouts", default=None, help=f"comma separated from {','.join(LAYOUTS)}")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: small size, 4 steps, 2 warm-up, fewer overhead reps")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu (gloo, the default) or cuda (nccl, one GPU per process)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend(s) for the compiled functp step, comma separated "
                         "(inductor, aot_eager); 'none' leaves it out")
    ap.add_argument("--compile-sizes", default="small",
                    help="sizes that get the compiled variant (default small: compiling costs "
                         "10-20 s per layout on 2 cores)")
    ap.add_argument("--overhead-nproc", default="2",
                    help="process counts that run the per-call collective bench (default 2: with "
                         "4 processes on 2 cores the latency of a collective is scheduler noise); "
                         "'none' skips it")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "compare.json"))
    ap.add_argument("--print", dest="show", metavar="JSON",
                    help="run nothing: print the tables of an earlier run's JSON")
    ap.add_argument("--markdown", action="store_true",
                    help="with --print: markdown tables (as in benchmarks/README.md)")
    a = ap.parse_args(argv)
    a.steps = a.steps or (4 if a.quick else 20)
    # at least 2: DDP rebuilds its buckets (a broadcast) in its second step
    a.warmup = max(2, a.warmup or 2)
    a.sizes = (a.sizes or ("small" if a.quick else "small,medium")).split(",")
    a.layouts = (a.layouts or ",".join(LAYOUTS)).split(",")
    a.compile_sizes = a.compile_sizes.split(",")
    a.overhead_nproc = [] if a.overhead_nproc == "none" else [int(v) for v in a.overhead_nproc.split(",")]
    a.nproc = [int(n) for n in a.nproc.split(",")]
    bad = [l for l in a.layouts if l not in LAYOUTS]
    if bad or any(n not in (2, 4) for n in a.nproc):
        ap.error(f"layouts must come from {LAYOUTS} and --nproc from 2,4 (got {a.layouts}, {a.nproc})")
    return a


# =====================================================================================
# everything below runs in the worker processes
# =====================================================================================

def _worker(args, out_path):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, HERE)
    import functp
    global _DEVICE
    _DEVICE = args.device
    torch.set_num_threads(1)
    if _DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    functp.make_mesh((int(os.environ["WORLD_SIZE"]),), ("dp",), device_type=_DEVICE)  # joins the group
    n, rank = dist.get_world_size(), dist.get_rank()
    rows, skipped, compile_info, overhead = [], [], [], []
    started = time.time()
    for layout in args.layouts:
        if layout == "2d" and n < 4:
            skipped.append({"layout": "2d", "nproc": n,
                            "why": "2-D needs 4 processes (dp=2 x tp=2); with 2 it is TP or DP"})
            continue
        for size in args.sizes:
            t0 = time.time()
            unsupported = _check_layout(layout, size, n)
            t_check = time.time() - t0
            for name, why in unsupported.items():
                skipped.append({"layout": layout, "nproc": n, "size": size, "variant": name, "why": why})
            rows += _bench_layout(layout, size, n, args, compile_info, drop=set(unsupported))
            if rank == 0:
                print(f"[compare] n={n} {layout:4} {size:6} checked in {t_check:.0f} s, timed in "
                      f"{time.time() - t0 - t_check:.0f} s", flush=True)
    if n in args.overhead_nproc:
        overhead = _bench_overhead(n, reps=5 if args.quick else 30)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"nproc": n, "rows": rows, "skipped": skipped, "compile": compile_info,
                       "overhead": overhead, "seconds": time.time() - started}, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- meshes

_DEVICE = "cpu"       # --device, set in each worker


def _sync() -> None:
    """Waits for the device: a step's time includes its kernels and collectives."""
    if _DEVICE == "cuda":
        import torch
        torch.cuda.synchronize()


def _mesh(layout, n):
    import functp
    if layout in ("dp", "fsdp"):
        return functp.make_mesh((n,), ("dp",), device_type=_DEVICE)
    if layout in ("tp", "sp"):
        return functp.make_mesh((n,), ("tp",), device_type=_DEVICE)
    return functp.make_mesh((2, n // 2), ("dp", "tp"), device_type=_DEVICE)


def _specs(layout, names):
    from functp import P
    if layout == "dp":
        return {k: P() for k in names}
    if layout == "fsdp":
        return {k: P("dp") for k in names}
    tp = {"norm.weight": P(), "fc1.weight": P("tp", None), "fc1.bias": P("tp"),
          "fc2.weight": P(None, "tp"), "fc2.bias": P()}
    return {k: tp[k.split(".", 2)[2]] for k in names}


def _data_spec(layout):
    from functp import P
    return {"dp": P("dp"), "fsdp": P("dp"), "tp": P(), "sp": P(None, "tp"), "2d": P("dp")}[layout]


# ------------------------------------------------------------------- the functp bodies

def _functp_body(layout, layers, n_elems):
    """The per-shard loss, written with functp's collectives."""
    import torch
    import functp
    import _models as M

    if layout == "dp":
        return lambda p, x, y: functp.pmean(M.mse(M.forward(p, x, layers), y), "dp")
    if layout == "fsdp":
        def params_of(p, i):
            # FSDP2's scheme: one all-gather per block of every parameter's dim-0 shard
            bp = M.block_params(p, i)
            rows = functp.all_gather(torch.cat([v.reshape(-1) for v in bp.values()]), "dp")
            out, off = {}, 0
            for k, v in bp.items():
                out[k] = rows[:, off:off + v.numel()].reshape(-1, *v.shape[1:])
                off += v.numel()
            return out
        return lambda p, x, y: functp.pmean(M.mse(M.forward(p, x, layers, params_of=params_of), y), "dp")
    if layout in ("tp", "2d"):
        def loss(p, x, y):
            out = M.forward(p, x, layers, post=lambda h: functp.psum(h, "tp"))
            return functp.pmean(M.mse(out, y), "dp") if layout == "2d" else M.mse(out, y)
        return loss
    if layout == "sp":
        def loss(p, x, y):
            out = M.forward(p, x, layers,
                            pre=lambda h: functp.all_gather(h, "tp", axis=1, tiled=True),
                            post=lambda h: functp.psum_scatter(h, "tp", scatter_dimension=1, tiled=True))
            return functp.psum(((out - y) ** 2).sum(), "tp") / n_elems
        return loss
    raise ValueError(layout)


def _plan(layout):
    if layout == "sp":
        return {"blocks.*.norm": "sequence_parallel", "blocks.*.fc1": "colwise",
                "blocks.*.fc2": "rowwise_sp"}
    return {"blocks.*.norm": "replicated", "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


# ------------------------------------------------------------ the hand-written floor

def _hand_functions():
    """Megatron-style autograd.Functions over raw torch.distributed collectives."""
    import torch
    import torch.distributed as dist
    from torch.autograd import Function

    class CopyToParallel(Function):          # Megatron's f: identity, all-reduce backward
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            dist.all_reduce(g, group=ctx.group)
            return g, None

    class ReduceFromParallel(Function):      # Megatron's g: all-reduce, identity backward
        @staticmethod
        def forward(ctx, x, group):
            x = x.contiguous()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, g):
            return g, None

    def _gather(x, dim, group, n):
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out.movedim(0, dim)

    def _reduce_scatter(x, dim, group, n):
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out.movedim(0, dim)

    class GatherSeq(Function):               # sequence-parallel entry: all-gather / reduce-scatter
        @staticmethod
        def forward(ctx, x, dim, group, n):
            ctx.dim, ctx.group, ctx.n = dim, group, n
            return _gather(x, dim, group, n)

        @staticmethod
        def backward(ctx, g):
            return _reduce_scatter(g, ctx.dim, ctx.group, ctx.n), None, None, None

    class ScatterSeq(Function):              # sequence-parallel exit: reduce-scatter / all-gather
        @staticmethod
        def forward(ctx, x, dim, group, n):
            ctx.dim, ctx.group, ctx.n = dim, group, n
            return _reduce_scatter(x, dim, group, n)

        @staticmethod
        def backward(ctx, g):
            return _gather(g, ctx.dim, ctx.group, ctx.n), None, None, None

    class GatherFlat(Function):              # FSDP unit: all-gather a flat shard, reduce-scatter grads
        @staticmethod
        def forward(ctx, flat, group, n):
            ctx.group, ctx.n = group, n
            out = flat.new_empty(n * flat.numel())
            dist.all_gather_into_tensor(out, flat.contiguous(), group=group)
            return out.view(n, -1)

        @staticmethod
        def backward(ctx, g):
            out = g.new_empty(g.shape[1])
            dist.reduce_scatter_tensor(out, g.contiguous().view(-1), group=ctx.group)
            return out, None, None

    def bucket_all_reduce(grads, group, scale):
        """One all-reduce for a list of gradients (DDP's bucket), scaled."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if scale != 1:
            flat.mul_(scale)
        return [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]), grads)]

    return CopyToParallel, ReduceFromParallel, GatherSeq, ScatterSeq, GatherFlat, bucket_all_reduce


# ------------------------------------------------------------------------- variants

class Variant:
    """``step()`` runs one training step; ``full()`` (after a step, all ranks) returns
    the global loss and the full gradients keyed by canonical parameter name.
    ``rank0_only``: the unsharded model, run by rank 0 while the others wait."""

    def __init__(self, name, kind, step, full, rank0_only=False, note="", may_fail=False):
        self.name, self.kind, self.step, self.full = name, kind, step, full
        self.rank0_only, self.note, self.may_fail = rank0_only, note, may_fail


def _build_variants(layout, size, n, dtype, compile_backend):
    import torch
    import torch.distributed as dist
    import functp
    import _models as M

    mesh = _mesh(layout, n)
    D, F = M.SIZES[size]
    L = M.LAYERS
    names = M.names(L)
    full_p = {k: v.to(_DEVICE) for k, v in M.init_params(D, F, L, dtype).items()}
    x, y = (t.to(_DEVICE) for t in M.init_data(D, dtype))
    specs = _specs(layout, names)
    dspec = _data_spec(layout)
    local = functp.shard(full_p, mesh, specs)
    xl, yl = functp.shard((x, y), mesh, dspec)
    n_elems = y.numel()
    dp = mesh.shape.get("dp", 1)
    tp = mesh.shape.get("tp", 1)
    dm = mesh.device_mesh
    g_dp = dm.get_group("dp") if "dp" in mesh.shape else None
    g_tp = dm.get_group("tp") if "tp" in mesh.shape else None
    out = []

    def reduce_loss(loss, op_scale):
        """The global loss from this rank's local contribution (for the check only)."""
        t = loss.detach().clone()
        dist.all_reduce(t)
        return t * op_scale

    # --- hand-written (the floor) -------------------------------------------------
    CopyTo, ReduceFrom, GatherSeq, ScatterSeq, GatherFlat, bucket = _hand_functions()
    hp = {k: v.clone().requires_grad_() for k, v in local.items()}
    hleaves = list(hp.values())
    if layout == "dp":
        def hand_step():
            loss = M.mse(M.forward(hp, xl, L), yl)
            grads = bucket(torch.autograd.grad(loss, hleaves), g_dp, 1.0 / dp)
            return loss, grads
        hand_full_loss = lambda loss: reduce_loss(loss, 1.0 / dp)
    elif layout == "fsdp":
        def params_of(p, i):
            bp = M.block_params(p, i)
            rows = GatherFlat.apply(torch.cat([v.reshape(-1) for v in bp.values()]), g_dp, dp)
            res, off = {}, 0
            for k, v in bp.items():
                res[k] = rows[:, off:off + v.numel()].reshape(-1, *v.shape[1:])
                off += v.numel()
            return res

        def hand_step():
            loss = M.mse(M.forward(hp, xl, L, params_of=params_of), yl) / dp
            return loss, torch.autograd.grad(loss, hleaves)
        hand_full_loss = lambda loss: reduce_loss(loss, 1.0)
    elif layout in ("tp", "2d"):
        def hand_step():
            out_ = M.forward(hp, xl, L, pre=lambda h: CopyTo.apply(h, g_tp),
                             post=lambda h: ReduceFrom.apply(h, g_tp))
            loss = M.mse(out_, yl)
            grads = torch.autograd.grad(loss, hleaves)
            if layout == "2d":
                grads = bucket(grads, g_dp, 1.0 / dp)
            return loss, grads
        hand_full_loss = (lambda loss: reduce_loss(loss, 1.0 / n)) if layout == "2d" else (lambda l: l.detach())
    else:  # sp
        repl = [i for i, k in enumerate(names) if specs[k].axes == ()]

        def hand_step():
            out_ = M.forward(hp, xl, L, pre=lambda h: GatherSeq.apply(h, 1, g_tp, tp),
                             post=lambda h: ScatterSeq.apply(h, 1, g_tp, tp))
            loss = ((out_ - yl) ** 2).sum() / n_elems
            grads = list(torch.autograd.grad(loss, hleaves))
            # replicated params (norms, fc2 bias) saw only this rank's tokens
            for i, gi in zip(repl, bucket([grads[i] for i in repl], g_tp, 1.0)):
                grads[i] = gi
            return loss, grads
        hand_full_loss = lambda loss: reduce_loss(loss, 1.0)

    def hand_full():
        loss, grads = hand_step()
        return hand_full_loss(loss), functp.unshard(dict(zip(names, grads)), mesh, specs)
    out.append(Variant("hand", "hand-written", hand_step, hand_full))

    # --- spmd_types (torchtitan's default SPMD layer), where installed ----------------
    if layout in ("tp", "sp", "2d"):
        v = _spmd_types_variant(layout, mesh, names, specs, local, xl, yl, n_elems, bucket,
                                hand_full_loss)
        if v is not None:
            out.append(v)

    # --- functp ---------------------------------------------------------------------
    body = _functp_body(layout, L, n_elems)
    in_specs = (specs, dspec, dspec)

    def functp_variants(tag, fn, sm_specs, params):
        """torch.func.grad and tape-autograd steps of the shard_map'd ``fn``."""
        res = []
        for check_vma in (True, False):
            sm = functp.shard_map(fn, mesh, in_specs=(sm_specs, dspec, dspec), out_specs=functp.P(),
                                  check_vma=check_vma)
            mode = "vma" if check_vma else "novma"
            gstep = (lambda sm=sm: torch.func.grad_and_value(sm)(params, xl, yl)[::-1])
            res.append((f"functp{tag} grad {mode}", gstep, sm))
            if tag:          # the plan variant: torch.func.grad with vma only
                break
            if check_vma:    # JAX's API with plain reverse mode at the top level
                vstep = (lambda sm=sm: functp.value_and_grad(sm)(params, xl, yl))
                res.append(("functp value_and_grad vma", vstep, sm))
            tparams = {k: v.clone().requires_grad_() for k, v in params.items()}
            tleaves = list(tparams.values())

            def tstep(sm=sm, tparams=tparams, tleaves=tleaves):
                loss = sm(tparams, xl, yl)
                return loss, dict(zip(tparams, torch.autograd.grad(loss, tleaves)))
            res.append((f"functp{tag} tape {mode}", tstep, sm))
        return res

    def functp_full(step, unshard):
        def full():
            loss, grads = step()
            return loss.detach(), unshard(grads)
        return full

    unshard = lambda g: functp.unshard(g, mesh, specs)
    for name, step, _ in functp_variants("", body, specs, local):
        out.append(Variant(name, "functp", step, functp_full(step, unshard)))
    if layout in ("tp", "sp", "2d"):
        module = M.MLPStack(full_p, L)
        apply, plocal, pspecs = functp.parallelize(module, mesh, _plan(layout), axis="tp")
        if layout == "sp":
            pbody = lambda p, x_, y_: functp.psum(((apply(p, x_) - y_) ** 2).sum(), "tp") / n_elems
        elif layout == "2d":
            pbody = lambda p, x_, y_: functp.pmean(M.mse(apply(p, x_), y_), "dp")
        else:
            pbody = lambda p, x_, y_: M.mse(apply(p, x_), y_)
        for name, step, _ in functp_variants(" plan", pbody, pspecs, plocal):
            out.append(Variant(name, "functp", step, functp_full(step, apply.unshard),
                               note="functp.parallelize (colwise/rowwise styles)"))
    for backend in [b for b in compile_backend.split(",") if b and b != "none"]:
        sm = functp.shard_map(body, mesh, in_specs=in_specs, out_specs=functp.P())
        graphs = []           # (kind, collectives) of every graph compiled
        compiled = torch.compile(sm, fullgraph=True, backend=_counting_backend(backend, graphs))
        cparams = {k: v.clone().requires_grad_() for k, v in local.items()}
        cleaves = list(cparams.values())

        def cstep(compiled=compiled, cparams=cparams, cleaves=cleaves):
            loss = compiled(cparams, xl, yl)
            return loss, dict(zip(cparams, torch.autograd.grad(loss, cleaves)))
        out.append(Variant(f"functp compiled tape ({backend})", "functp", cstep,
                           functp_full(cstep, unshard),
                           note="forward torch.compile(fullgraph=True), backward torch.autograd.grad; "
                                "collectives counted in the compiled graphs", may_fail=True))
        out[-1].graphs, out[-1].expected_graphs = graphs, 2
        # the whole torch.func.grad step in one graph
        ggraphs = []
        gsm = functp.shard_map(body, mesh, in_specs=in_specs, out_specs=functp.P())
        gcompiled = torch.compile(torch.func.grad_and_value(gsm), fullgraph=True,
                                  backend=_counting_backend(backend, ggraphs))

        def gstep(gcompiled=gcompiled):
            grads, loss = gcompiled(local, xl, yl)
            return loss, grads
        out.append(Variant(f"functp compiled grad ({backend})", "functp", gstep,
                           functp_full(gstep, unshard),
                           note="torch.compile(torch.func.grad_and_value(shard_map), fullgraph=True); "
                                "collectives counted in the compiled graph", may_fail=True))
        out[-1].graphs, out[-1].expected_graphs = ggraphs, 1

    # --- PyTorch -------------------------------------------------------------------
    out.append(_torch_variant(layout, mesh, full_p, names, specs, x, y, xl, yl, n_elems, L))

    # --- unsharded, rank 0 ------------------------------------------------------------
    if dist.get_rank() == 0:
        umod = M.MLPStack(full_p, L)
        uparams = list(umod.parameters())

        def ustep():
            loss = M.mse(umod(x), y)
            return loss, torch.autograd.grad(loss, uparams)

        def ufull():
            loss, grads = ustep()
            return loss.detach(), dict(zip([k for k, _ in umod.named_parameters()], grads))
        uloss = lambda p: M.mse(M.forward(p, x, L), y)
        ugrad = torch.func.grad_and_value(uloss)

        def gstep():
            grads, loss = ugrad(full_p)
            return loss, grads
        gfull = lambda: (lambda g, l: (l.detach(), g))(*ugrad(full_p))
    else:
        ustep = gstep = lambda: None
        ufull = gfull = lambda: (None, None)
    out.append(Variant("unsharded (rank 0)", "unsharded", ustep, ufull, rank0_only=True,
                       note="the whole model on one process; the others wait"))
    # what torch.func.grad itself costs over tape autograd, with no collective at all:
    # it differentiates with create_graph=True, so the backward is recorded too and
    # no saved activation is freed before the step ends
    out.append(Variant("unsharded grad (rank 0)", "unsharded", gstep, gfull, rank0_only=True,
                       note="torch.func.grad_and_value of the model function on one process"))
    return out


def _spmd_types_variant(layout, mesh, names, specs, local, xl, yl, n_elems, bucket,
                        full_loss):
    """The step written with spmd_types 0.3.1's local SPMD types, as its docs recommend
    (docs/local_spmd_types.md, "Tensor parallelism"): a type asserted on every
    parameter once, by a helper at setup (the type stays on the tensor); column-parallel entry ``invariant_to_replicate`` (TP) or
    ``all_gather(src=S(seq), dst=R)`` (SP); row-parallel exit ``all_reduce(dst=I)``
    (TP) or ``reduce_scatter(dst=S(seq))`` (SP); the gradients of parameters that
    are replicated over dp (and, in SP, over tp) reduced after backward by the
    "wrapper" (here one bucket, as the hand-written step does). Tape autograd:
    spmd_types' Functions have no ``setup_context`` for torch.func. None when
    spmd_types is not installed (``pip install -e ".[bench]"``)."""
    try:
        import spmd_types as spmd
    except ImportError:
        return None
    import torch
    import functp
    import _models as M
    dm = mesh.device_mesh
    g_tp = dm.get_group("tp")
    g_dp = dm.get_group("dp") if "dp" in mesh.shape else None
    dp = mesh.shape.get("dp", 1)
    sp = layout == "sp"
    sp_params = {k: v.clone().requires_grad_() for k, v in local.items()}
    leaves = list(sp_params.values())
    # TP-sharded parameters vary over tp; the others are invariant (TP: module
    # responsibility) or replicated with the reduction left to the wrapper (SP)
    types = {k: {g_tp: spmd.V if specs[k].axes else (spmd.R if sp else spmd.I)} for k in names}
    repl = [i for i, k in enumerate(names) if not specs[k].axes]
    if sp:
        pre = lambda h: spmd.all_gather(h, g_tp, src=spmd.S(1), dst=spmd.R)
        post = lambda h: spmd.reduce_scatter(h, g_tp, dst=spmd.S(1))
    else:
        pre = lambda h: spmd.invariant_to_replicate(h, g_tp)
        post = lambda h: spmd.all_reduce(h, g_tp, dst=spmd.I)

    with spmd.set_current_mesh(dm):
        for k, v in sp_params.items():
            spmd.assert_type(v, types[k])

    def step():
        with spmd.set_current_mesh(dm):
            out_ = M.forward(sp_params, xl, M.LAYERS, pre=pre, post=post)
            loss = ((out_ - yl) ** 2).sum() / n_elems if sp else M.mse(out_, yl)
            grads = list(torch.autograd.grad(loss, leaves))
        if sp:
            for i, gi in zip(repl, bucket([grads[i] for i in repl], g_tp, 1.0)):
                grads[i] = gi
        if g_dp is not None:
            grads = bucket(grads, g_dp, 1.0 / dp)
        return loss, grads

    def full():
        loss, grads = step()
        return full_loss(loss), functp.unshard(dict(zip(names, grads)), mesh, specs)
    return Variant("spmd_types", "spmd_types", step, full,
                   note="spmd_types' Megatron recipe (local SPMD types), tape autograd")


def _torch_variant(layout, mesh, full_p, names, specs, x, y, xl, yl, n_elems, L):
    """The PyTorch library version of the layout."""
    import torch
    import torch.distributed as dist
    import functp
    import _models as M
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    from torch.nn.parallel import DistributedDataParallel as DDP

    dm = mesh.device_mesh
    module = M.MLPStack(full_p, L)
    dp = mesh.shape.get("dp", 1)
    canon = lambda k: k.replace("module.", "").replace("_fsdp_wrapped_module.", "")

    def finalize(model):
        """DTensor leaves a replicated parameter's gradient Partial when its uses were
        sharded (SP norms); an optimizer would reduce it first, so the step does."""
        for p in held.values():
            g = p.grad
            if isinstance(g, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(placements=p.placements)

    if layout == "dp":
        model = DDP(module, device_ids=[torch.cuda.current_device()] if _DEVICE == "cuda" else None)
        name, note = "DDP", "DistributedDataParallel, default buckets"
        loss_fn = lambda: M.mse(model(xl), yl)
        loss_scale = 1.0 / dp
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for b in module.blocks:
            fully_shard(b, mesh=dm, reshard_after_forward=False)
        model = fully_shard(module, mesh=dm, reshard_after_forward=False)
        name, note = "FSDP2 fully_shard", "one unit per block, reshard_after_forward=False"
        loss_fn = lambda: M.mse(model(xl), yl)
        loss_scale = 1.0 / dp
    else:
        tpm = dm["tp"] if layout == "2d" else dm
        if layout == "sp":
            plan = {"blocks.*.norm": SequenceParallel(),
                    "blocks.*.fc1": ColwiseParallel(input_layouts=Shard(1)),
                    "blocks.*.fc2": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {"blocks.*.fc1": ColwiseParallel(), "blocks.*.fc2": RowwiseParallel()}
        model = parallelize_module(module, tpm, plan)
        name = {"tp": "DTensor TP", "sp": "DTensor SP", "2d": "DTensor TP + DDP"}[layout]
        note = "parallelize_module " + ("+ SequenceParallel norms" if layout == "sp" else "colwise/rowwise")
        if layout == "2d":
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
            _pre_dp_module_transform(model)
            # After the first forward, torch 2.13's hooks leave the TP weights as plain
            # DTensor attributes: named_parameters()/zero_grad() no longer see them. Keep
            # the local Parameters DDP reduces (what an optimizer built now would hold).
            held = dict(model.named_parameters())
            model = DDP(model, process_group=dm.get_group("dp"))
            note += "; DDP over dp via _pre_dp_module_transform"
        if layout == "sp":
            loss_fn = lambda: ((model(xl) - yl) ** 2).sum() / n_elems
            loss_scale = 1.0
        else:
            loss_fn = lambda: M.mse(model(xl), yl)
            loss_scale = 1.0 / mesh.size     # every tp rank holds a copy of its dp shard's loss

    if layout != "2d":
        held = dict(model.named_parameters())

    def step():
        for p in held.values():
            p.grad = None
        loss = loss_fn()
        loss.backward()
        finalize(model)
        return loss, None

    def full():
        loss, _ = step()
        t = loss.detach().clone()
        if layout != "tp":
            dist.all_reduce(t)
            t = t * loss_scale
        grads = {}
        for k, p in held.items():
            g = p.grad
            grads[canon(k)] = g.full_tensor() if isinstance(g, DTensor) else g
        if layout == "2d":       # DDP holds the TP-local tensors (not DTensors) here
            grads = functp.unshard(grads, mesh, specs)
        return t, grads
    return Variant(name, "torch", step, full, note=note)


def _graph_collectives(graph):
    """The collectives in a compiled FX graph, as (op, bytes of the input buffer)."""
    import torch
    found = []
    for node in graph.nodes:
        t = node.target
        if (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
                and t.namespace in ("_c10d_functional", "c10d")
                and t._opname in _CommCounter.OPS):
            arg = node.args[_CommCounter.INPUT_ARG.get(t._opname, 0)]
            vals = arg if isinstance(arg, (list, tuple)) else [arg]
            nbytes = sum(v.meta["val"].numel() * v.meta["val"].element_size()
                         for v in vals if hasattr(v, "meta") and "val" in v.meta)
            found.append((_CommCounter.OPS[t._opname], nbytes))
    return found


def _counting_backend(name, graphs):
    """``name`` as a torch.compile backend that also records the collectives of every
    forward/backward graph it compiles (Dynamo refuses to run with a dispatch mode
    active, so compiled steps are counted from their graphs)."""
    import functools
    if name == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        def compiler(kind):
            def comp(gm, example_inputs):
                graphs.append((kind, _graph_collectives(gm.graph)))
                return boxed_nop(gm, example_inputs)
            return comp
        return functools.partial(aot_eager, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
    if name == "inductor":
        import torch._inductor.config as icfg
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class Count(CustomGraphPass):
            def __call__(self, graph):
                graphs.append(("graph", _graph_collectives(graph)))

            def uuid(self):
                return None
        from torch._inductor.compile_fx import compile_fx

        def backend(gm, example_inputs):
            # the pass is global: point it at this variant's list while it compiles
            icfg.post_grad_custom_post_pass = Count()
            icfg.fx_graph_cache = False
            return compile_fx(gm, example_inputs)
        return backend
    return name


# ------------------------------------------------------------------------- the check

def _check_layout(layout, size, n):
    """Every variant's loss and gradients equal the unsharded model's, in float64."""
    import torch
    import torch._dynamo
    import torch.distributed as dist
    import _models as M
    D, F = M.SIZES[size]
    p = M.init_params(D, F, M.LAYERS, torch.float64)
    x, y = M.init_data(D, torch.float64)
    ref_g, ref_l = torch.func.grad_and_value(M.global_loss)(p, x, y)
    problems, unsupported = [], {}
    torch._dynamo.reset()
    backend = _ARGS.compile_backend if size in _ARGS.compile_sizes else "none"
    for v in _build_variants(layout, size, n, torch.float64, backend):
        try:
            for _ in range(2):           # DDP rebuilds its buckets on the second step
                loss, grads = v.full()
        except Exception as e:  # noqa: BLE001 - reported below, on every rank
            if v.may_fail:       # torch.compile: a failure to compile is reported, not fatal
                msg = str(e).strip().splitlines() or [""]
                ctx = [m.strip() for m in msg if "debug context" in m]
                unsupported[v.name] = f"{type(e).__name__}: {msg[0][:160]}" + (f" ({ctx[0][:160]})" if ctx else "")
            else:
                problems.append(f"{v.name}: raised\n{traceback.format_exc()}")
            continue
        if v.rank0_only and dist.get_rank() != 0:
            continue
        if not torch.allclose(loss, ref_l, rtol=1e-9, atol=1e-12):
            problems.append(f"{v.name}: loss {loss.item()!r} != {ref_l.item()!r}")
        if set(grads) != set(ref_g):
            problems.append(f"{v.name}: gradient keys differ: {sorted(set(grads) ^ set(ref_g))}")
            continue
        for k in ref_g:
            if grads[k].shape != ref_g[k].shape or not torch.allclose(grads[k], ref_g[k], rtol=1e-9, atol=1e-12):
                err = ((grads[k] - ref_g[k]).abs().max().item()
                       if grads[k].shape == ref_g[k].shape else f"shape {tuple(grads[k].shape)}")
                problems.append(f"{v.name}: grad {k} differs from the unsharded model (max err {err})")
    flag = torch.tensor([float(len(problems))])
    dist.all_reduce(flag)
    if flag.item():
        msg = (f"\n{'!' * 78}\nMISMATCH on rank {dist.get_rank()} ({layout}, {size}, {n} processes): "
               f"a variant does not compute the unsharded model's loss/gradients:\n  "
               + "\n  ".join(problems or ["(this rank is fine; see the others)"]) + f"\n{'!' * 78}")
        print(msg, file=sys.stderr, flush=True)
        dist.barrier()
        raise SystemExit(3)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, unsupported)
    for e in everyone:
        for k, why in e.items():
            unsupported.setdefault(k, why)
    return unsupported


# ------------------------------------------------------------------------- measuring

class _CommCounter:
    """Counts every collective that reaches the dispatcher: the c10d ops behind
    torch.distributed.* (DDP's C++ reducer and FSDP2 included) and the functional
    ones (torch.ops._c10d_functional.*: funcol, DTensor, functp). ``bytes`` is the
    size of this rank's input buffer, as functp.comm_log counts it."""

    OPS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
           "all_reduce_coalesced": "all_reduce", "allreduce_coalesced_": "all_reduce",
           "_allgather_base_": "all_gather", "allgather_": "all_gather",
           "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
           "allgather_into_tensor_coalesced_": "all_gather",
           "all_gather_into_tensor_coalesced": "all_gather",
           "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
           "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
           "reduce_scatter_tensor_coalesced_": "reduce_scatter",
           "broadcast_": "broadcast", "broadcast": "broadcast", "alltoall_base_": "all_to_all",
           "all_to_all_single": "all_to_all", "alltoall_": "all_to_all", "send": "send", "recv_": "recv",
           "barrier": "barrier", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter"}
    INPUT_ARG = {"_allgather_base_": 1, "allgather_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_": 1,
                 "alltoall_base_": 1, "alltoall_": 1}

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        import torch
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional"):
                    op = func._opname
                    if op in counter.OPS:
                        counter.events.append((counter.OPS[op], counter._nbytes(op, args)))
                    elif op not in ("wait_tensor", "_wrap_tensor_autograd"):
                        counter.unknown.add(f"{func.namespace}.{op}")
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        self.events, self.unknown = [], set()
        self._torch = torch

    def _nbytes(self, op, args):
        a = args[self.INPUT_ARG.get(op, 0)] if args else None
        flat = []

        def walk(t):
            if isinstance(t, self._torch.Tensor):
                flat.append(t)
            elif isinstance(t, (list, tuple)):
                for u in t:
                    walk(u)
        walk(a)
        return sum(t.numel() * t.element_size() for t in flat)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def summary(self):
        s = {}
        for op, b in self.events:
            c, nb = s.get(op, (0, 0))
            s[op] = (c + 1, nb + b)
        return s


_LIBC = None


def _status_bytes(key):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


class _LiveBytes:
    """The peak, during one step, of the bytes held by tensor storages the step
    allocated (a ``TorchDispatchMode`` sees every op's outputs; a storage counts until
    it is freed). Deterministic, unlike resident memory: what a caching GPU allocator's
    ``max_memory_allocated`` would report, less the allocator's rounding. Tensors made
    below the dispatcher (a C++ reducer's buffers) are not seen."""

    def __init__(self):
        import torch
        import torch.utils._pytree as pytree
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        live = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                # a view's or an in-place op's output has its input's storage: one
                # not seen yet was allocated before the step (a parameter)
                given = {live.key(t) for t in pytree.tree_leaves((args, kwargs))
                         if isinstance(t, torch.Tensor)}
                for t in pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        live.add(t, StorageWeakRef, given)
                return out
        self.mode, self.refs, self.peak = Mode(), {}, 0

    @staticmethod
    def key(t):
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):   # a subclass without a storage
            return None

    def add(self, t, weak_ref, given) -> None:
        key = self.key(t)
        if key and key not in given and (key not in self.refs or self.refs[key][0].expired()):
            st = t.untyped_storage()
            self.refs[key] = (weak_ref(st), st.nbytes())
        total = 0
        for k, (ref, nbytes) in list(self.refs.items()):
            if ref.expired():
                del self.refs[k]
            else:
                total += nbytes
        self.peak = max(self.peak, total)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _fmt_mib(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _peak_rss_rise(fn):
    """Peak resident memory during ``fn()`` above what was resident before it: freed
    heap memory is given back first (malloc_trim), then the kernel's peak-RSS mark is
    reset (/proc/self/clear_refs) and read back afterwards (VmHWM). On CUDA: the peak
    of the caching allocator's allocated bytes above those allocated before."""
    if _DEVICE == "cuda":
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        res = fn()
        torch.cuda.synchronize()
        del res
        return torch.cuda.max_memory_allocated() - before
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    res = fn()
    peak = _status_bytes("VmHWM")
    del res
    return peak - before


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _bench_layout(layout, size, n, args, compile_info, drop=()):
    import torch
    import torch.distributed as dist
    import torch._dynamo
    import functp
    rank = dist.get_rank()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = args.compile_backend if size in args.compile_sizes else "none"
    variants = [v for v in _build_variants(layout, size, n, torch.float32, backend)
                if v.name not in drop]
    names = [v.name for v in variants]
    warm, dyn = {}, {}
    c = torch._dynamo.utils.counters

    def dynamo_state():
        return (sum(c["graph_break"].values()), c["stats"].get("unique_graphs", 0), set(c["graph_break"]))
    for w in range(args.warmup):
        for v in variants:
            dist.barrier()
            before = dynamo_state()
            t0 = time.perf_counter()
            if not (v.rank0_only and rank != 0):
                v.step()
            if w == 0:
                warm[v.name] = time.perf_counter() - t0
                after = dynamo_state()
                dyn[v.name] = (after[0] - before[0], after[1] - before[1], sorted(after[2] - before[2]))
    for v in variants:
        if v.name.startswith("functp compiled"):
            breaks, graphs, reasons = dyn[v.name]
            compile_info.append({"nproc": n, "layout": layout, "size": size, "variant": v.name,
                                 "aot_graphs": [kind for kind, _ in v.graphs],
                                 "first_call_s": warm[v.name], "graph_breaks": breaks,
                                 "graph_break_reasons": reasons[:5], "unique_graphs": graphs,
                                 "fullgraph": True})
    # collectives per step: functp's own log and the dispatcher-level counter
    counts, logs, unknown = {}, {}, set()
    for v in variants:
        if v.rank0_only and rank != 0:
            counts[v.name] = {}
            continue
        if getattr(v, "graphs", None) is not None:
            # every graph this variant compiled (one forward, one backward) runs once a step
            if len(v.graphs) != v.expected_graphs:
                v.note += f"; {len(v.graphs)} graphs compiled, their collectives summed"
            s = {}
            for op, b in (e for _, evs in v.graphs for e in evs):
                c, nb = s.get(op, (0, 0))
                s[op] = (c + 1, nb + b)
            counts[v.name] = s
            logs[v.name] = None
            continue
        with _CommCounter() as cc, functp.comm_log() as log:
            v.step()
        counts[v.name] = cc.summary()
        unknown |= cc.unknown
        logs[v.name] = (len(log), sum(e.nbytes for e in log.events)) if v.kind == "functp" else None
    # per rank: the Python calls (functions and builtins) of one step, and how far
    # one step raises peak memory (the smaller of 2)
    pycalls, mem, live = {}, {}, {}
    for v in variants:
        dist.barrier()
        if v.rank0_only and rank != 0:
            pycalls[v.name] = mem[v.name] = live[v.name] = 0
            continue
        prof = cProfile.Profile()
        prof.enable()
        v.step()
        prof.disable()
        pycalls[v.name] = pstats.Stats(prof).total_calls
        mem[v.name] = min(_peak_rss_rise(v.step) for _ in range(2))
        if getattr(v, "graphs", None) is None and _DEVICE == "cpu":
            with _LiveBytes() as lb:     # (Dynamo refuses to run under a dispatch mode)
                v.step()
            live[v.name] = lb.peak
    dist.barrier()
    # timing: variants alternate, the order rotating every round
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}       # this process's CPU time (all its threads)
    for i in range(args.steps):
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            if not (v.rank0_only and rank != 0):
                v.step()
                _sync()
            times[v.name].append(time.perf_counter() - t0)
            cpu[v.name].append(time.process_time() - c0)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"times": times, "cpu": cpu, "mem": mem, "live": live})
    rows = []
    if rank != 0:
        return rows
    # a step's time is its slowest rank's (rank 0 alone for the unsharded model)
    step_t = {k: ([everyone[0]["times"][k][i] for i in range(args.steps)]
                  if variants[names.index(k)].rank0_only else
                  [max(e["times"][k][i] for e in everyone) for i in range(args.steps)])
              for k in names}
    hand = step_t["hand"]
    # a step's CPU time: the sum over its ranks (the work done, whatever the wait)
    step_cpu = {k: [sum(e["cpu"][k][i] for e in everyone) for i in range(args.steps)]
                for k in names}
    for v in variants:
        ratios = [a / b for a, b in zip(step_t[v.name], hand)]
        cratios = [a / b for a, b in zip(step_cpu[v.name], step_cpu["hand"])]
        c = counts[v.name]
        row = {"nproc": n, "layout": layout, "size": size, "variant": v.name, "kind": v.kind,
               "note": v.note, "ms": 1e3 * statistics.median(step_t[v.name]),
               "ratio": statistics.median(ratios), "ratio_p10": _quantile(ratios, 0.1),
               "ratio_p90": _quantile(ratios, 0.9),
               "cpu_ms": 1e3 * statistics.median(step_cpu[v.name]),
               "cpu_ratio": statistics.median(cratios),
               "cpu_ratio_p10": _quantile(cratios, 0.1), "cpu_ratio_p90": _quantile(cratios, 0.9),
               "collectives": sum(cnt for cnt, _ in c.values()),
               "bytes": sum(b for _, b in c.values()),
               "by_op": {op: list(cb) for op, cb in sorted(c.items())},
               "peak_mib": max(e["mem"][v.name] for e in everyone) / 2 ** 20,
               "live_mib": (max(e["live"].get(v.name, 0) for e in everyone) / 2 ** 20
                            if v.name in live else None),
               "py_calls": pycalls[v.name],        # rank 0's
               "first_step_s": warm.get(v.name)}
        if logs.get(v.name) is not None:
            row["comm_log"] = list(logs[v.name])
            if logs[v.name] != (row["collectives"], row["bytes"]) and "compiled" not in v.name:
                row["note"] = (row["note"] + "; " if row["note"] else "") + \
                    f"comm_log says {logs[v.name]} (differs from the dispatcher count)"
        if unknown:
            row["uncounted_ops"] = sorted(unknown)
        rows.append(row)
    return rows


# ------------------------------------------------------- per-call collective overhead

def _bench_overhead(n, reps, k_calls=16, numel=256):
    """Cost of a 1 KiB (256 float32) all-reduce: raw torch.distributed.all_reduce, the
    raw functional collective + wait_tensor, and functp.psum inside a shard_map body
    (eager, under torch.func.grad, through tape autograd), each timed with one call
    and with ``k_calls`` calls summed into one result (one shard_map call either way).
    Methods alternate, the order rotating every repetition."""
    import torch
    import torch.distributed as dist
    import functp
    from functp import P
    mesh = functp.make_mesh((n,), ("dp",))
    group = mesh.device_mesh.get_group("dp")
    gname = group.group_name
    x = torch.randn(numel, device=_DEVICE)
    ops = torch.ops._c10d_functional

    def raw_dist(k):
        s = None
        for _ in range(k):
            t = x.clone()
            dist.all_reduce(t, group=group)
            s = t if s is None else s + t
        return s

    def raw_funcol(k):
        s = None
        for _ in range(k):
            t = ops.wait_tensor(ops.all_reduce(x, "sum", gname))
            s = t if s is None else s + t
        return s

    def body(k):
        def f(xb):          # psums of a varying block, summed: an invariant result
            s = functp.psum(xb, "dp")
            for _ in range(k - 1):
                s = s + functp.psum(xb, "dp")
            return s
        return f

    methods = {}
    for k in (1, k_calls):
        methods[("torch.distributed.all_reduce", k)] = lambda k=k: raw_dist(k)
        methods[("_c10d_functional.all_reduce + wait_tensor", k)] = lambda k=k: raw_funcol(k)
        for vma in (True, False):
            tag = "vma" if vma else "novma"
            sm = functp.shard_map(body(k), mesh, in_specs=P("dp"), out_specs=P(), check_vma=vma)
            methods[(f"functp.psum eager, {tag}", k)] = lambda sm=sm: sm(x)
            methods[(f"functp.psum under torch.func.grad, {tag}", k)] = \
                lambda sm=sm: torch.func.grad(lambda t: sm(t).sum())(x)
            xr = x.clone().requires_grad_()
            methods[(f"functp.psum tape autograd (fwd+bwd), {tag}", k)] = \
                lambda sm=sm, xr=xr: torch.autograd.grad(sm(xr).sum(), [xr])
    keys = list(methods)
    calls = {}
    for key in keys:            # warm-up, and collectives per call from the dispatcher
        methods[key]()
        with _CommCounter() as cc:
            methods[key]()
        calls[key] = len(cc.events)
    times = {key: [] for key in keys}
    for r in range(reps):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for key in order:
            dist.barrier()
            t0 = time.perf_counter()
            methods[key]()
            _sync()
            times[key].append(time.perf_counter() - t0)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if dist.get_rank() != 0:
        return []
    slowest = {key: [max(e[key][i] for e in everyone) for i in range(reps)] for key in keys}
    rows = []
    for name in dict.fromkeys(k for k, _ in keys):
        many = [t / k_calls for t in slowest[(name, k_calls)]]
        rows.append({"nproc": n, "method": name, "us_per_call": 1e6 * statistics.median(many),
                     "us_per_call_p10": 1e6 * _quantile(many, 0.1),
                     "us_per_call_p90": 1e6 * _quantile(many, 0.9),
                     "one_call_us": 1e6 * statistics.median(slowest[(name, 1)]),
                     "collectives_per_call": calls[(name, k_calls)] / k_calls,
                     "numel": numel, "calls": k_calls, "reps": reps})
    return rows


# =====================================================================================
# the launcher: runs the workers for each process count, merges, prints, writes JSON
# =====================================================================================

def _fmt_bytes(b):
    return f"{b / 2 ** 20:.2f}M" if b >= 2 ** 20 else f"{b / 2 ** 10:.1f}K"


def _table(result) -> str:
    lines = []
    hdr = (f"{'n':>1} {'layout':6} {'size':6} {'variant':32} {'ms':>8} {'/hand':>6} {'p10-p90':>11} "
           f"{'cpu/hand':>8} {'colls':>5} {'bytes':>8} {'peakMiB':>7} {'liveMiB':>7} {'pycalls':>7}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    prev = None
    for r in result["rows"]:
        key = (r["nproc"], r["layout"], r["size"])
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        lines.append(f"{r['nproc']:>1} {r['layout']:6} {r['size']:6} {r['variant'][:32]:32} {r['ms']:8.2f} "
                     f"{r['ratio']:6.2f} {r['ratio_p10']:5.2f}-{r['ratio_p90']:<5.2f} "
                     f"{r.get('cpu_ratio', float('nan')):8.2f} {r['collectives']:5d} {_fmt_bytes(r['bytes']):>8} {r['peak_mib']:7.2f} "
                     f"{_fmt_mib(r.get('live_mib')):>7} {r.get('py_calls', 0):7d}")
    if result["skipped"]:
        lines.append("")
        for s in result["skipped"]:
            what = f"{s['variant']} for {s['layout']} {s['size']}" if "variant" in s else s["layout"]
            lines.append(f"not compared: {what} with {s['nproc']} processes: {s['why']}")
    if result["compile"]:
        lines.append("")
        lines.append("torch.compile of functp steps (fullgraph=True; tape: compiled forward, "
                     "torch.autograd.grad backward; grad: torch.func.grad_and_value in one graph):")
        lines.append(f"  {'n':>1} {'layout':6} {'size':6} {'variant':32} {'first call s':>12} {'graph breaks':>12} "
                     f"{'graphs':>6} {'compiled/eager':>14}")
        for c in result["compile"]:
            backend = c["variant"][len("functp compiled "):]
            lines.append(f"  {c['nproc']:>1} {c['layout']:6} {c['size']:6} {backend:32} {c['first_call_s']:12.1f} "
                         f"{c['graph_breaks']:12d} {c['unique_graphs']:6d} "
                         f"{c.get('vs_eager', float('nan')):14.2f}")
    if result["overhead"]:
        lines.append("")
        o0 = result["overhead"][0]
        lines.append(f"cost of a 1 KiB all-reduce: time per call with {o0['calls']} calls in a row (median, p10-p90 "
                     f"over {o0['reps']} reps), and the time of a whole call with just one:")
        lines.append(f"  {'n':>1} {'method':44} {'us/call':>8} {'p10-p90':>12} {'colls/call':>10} {'1 call us':>9}")
        for o in result["overhead"]:
            lines.append(f"  {o['nproc']:>1} {o['method']:44} {o['us_per_call']:8.0f} "
                         f"{o['us_per_call_p10']:5.0f}-{o['us_per_call_p90']:<6.0f} "
                         f"{o['collectives_per_call']:10.1f} {o['one_call_us']:9.0f}")
    return "\n".join(lines)


def _ratio_table(groups, cols, key, first, first_key) -> str:
    """One cell per variant: its ``key`` ratio to the hand-written step (the PyTorch
    column names its variant in the time table)."""
    lines = [f"| n | layout | size | {first} | " + " | ".join(
        c.replace("functp ", "") if c != "torch" else "PyTorch" for c in cols) + " |",
        "|---" * (4 + len(cols)) + "|"]
    for (n, layout, size), rs in groups.items():
        by = {r["variant"]: r for r in rs}
        cells = []
        for c in cols:
            r = (next((r for r in rs if r["kind"] == "torch"), None) if c == "torch" else
                 next((r for r in rs if r["variant"].startswith(c)), None))
            cells.append("–" if r is None or key not in r else
                         f"{r[key]:.2f} ({r['variant']})" if c == "torch" and key == "ratio" else
                         f"{r[key]:.2f}")
        lines.append(f"| {n} | {layout} | {size} | {by['hand'].get(first_key, float('nan')):.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _memory_table(groups) -> str:
    """Live tensor memory at the step's peak, as a ratio to the hand-written step's;
    the last column is torch.func.grad's own cost (unsharded, no collectives)."""
    cols = ["functp grad vma", "functp tape vma", "functp grad novma", "functp tape novma"]
    lines = ["| n | layout | size | hand live MiB | " + " | ".join(c[len("functp "):] for c in cols)
             + " | unsharded: grad / tape |", "|---" * (5 + len(cols)) + "|"]
    for (n, layout, size), rs in groups.items():
        by = {r["variant"]: r.get("live_mib") for r in rs}
        hand = by.get("hand")
        if not hand:
            continue
        cells = [f"{by[c] / hand:.2f}" if by.get(c) else "–" for c in cols]
        ug, ut = by.get("unsharded grad (rank 0)"), by.get("unsharded (rank 0)")
        cells.append(f"{ug / ut:.2f}" if ug and ut else "–")
        lines.append(f"| {n} | {layout} | {size} | {hand:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _markdown(result) -> str:
    """The README's tables: ratios at a glance, then every row."""
    rows, out = result["rows"], []
    cols = ["functp grad vma", "functp grad novma", "functp tape vma", "functp tape novma",
            "functp plan grad vma", "functp compiled tape", "functp compiled grad", "spmd_types",
            "torch", "unsharded (rank 0)", "unsharded grad (rank 0)"]
    groups = {}
    for r in rows:
        groups.setdefault((r["nproc"], r["layout"], r["size"]), []).append(r)
    out.append(_ratio_table(groups, cols, "ratio", "hand ms", "ms"))
    out.append("")
    out.append(_ratio_table(groups, cols, "cpu_ratio", "hand CPU ms", "cpu_ms"))
    out.append("")
    out.append(_memory_table(groups))
    out.append("")
    out.append("| n | layout | size | variant | ms | / hand | p10–p90 | CPU / hand | p10–p90 | collectives | bytes | by op | peak MiB | live MiB | Python calls |")
    out.append("|---|---|---|---|---:|---:|---|---:|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        ops = ", ".join(f"{op} {c}" for op, (c, _) in r["by_op"].items()) or "–"
        out.append(f"| {r['nproc']} | {r['layout']} | {r['size']} | {r['variant']} | {r['ms']:.1f} | "
                   f"{r['ratio']:.2f} | {r['ratio_p10']:.2f}–{r['ratio_p90']:.2f} | "
                   f"{r.get('cpu_ratio', float('nan')):.2f} | "
                   f"{r.get('cpu_ratio_p10', float('nan')):.2f}–{r.get('cpu_ratio_p90', float('nan')):.2f} | "
                   f"{r['collectives']} | "
                   f"{_fmt_bytes(r['bytes'])} | {ops} | {r['peak_mib']:.2f} | "
                   f"{_fmt_mib(r.get('live_mib'))} | {r.get('py_calls', '–')} |")
    if result["compile"]:
        out.append("")
        out.append("| n | layout | size | compiled step | first call (compile) s | graph breaks | Dynamo graphs | compiled / eager |")
        out.append("|---|---|---|---|---:|---:|---:|---:|")
        for c in result["compile"]:
            backend = c["variant"][len("functp compiled "):]
            out.append(f"| {c['nproc']} | {c['layout']} | {c['size']} | {backend} | {c['first_call_s']:.1f} | "
                       f"{c['graph_breaks']} | {c['unique_graphs']} | {c.get('vs_eager', float('nan')):.2f} |")
    if result["overhead"]:
        out.append("")
        out.append("| n | method | µs per call (median) | p10–p90 | collectives per call | µs, whole call with one |")
        out.append("|---|---|---:|---|---:|---:|")
        for o in result["overhead"]:
            out.append(f"| {o['nproc']} | {o['method']} | {o['us_per_call']:.0f} | "
                       f"{o['us_per_call_p10']:.0f}–{o['us_per_call_p90']:.0f} | "
                       f"{o['collectives_per_call']:.1f} | {o['one_call_us']:.0f} |")
    if result["skipped"]:
        out.append("")
        for s in result["skipped"]:
            what = f"{s['variant']} for {s['layout']} {s['size']}" if "variant" in s else s["layout"]
            out.append(f"- not compared: {what} with {s['nproc']} processes: {s['why']}")
    return "\n".join(out)


def main(argv=None):
    if "RANK" in os.environ:          # a worker: the launcher's arguments come in the environment
        argv = json.loads(os.environ["COMPARE_ARGS"])
    args = _parse(argv)
    if args.show:
        with open(args.show) as f:
            result = json.load(f)
        cfg = result["config"]
        print(f"{cfg['command']}  ({cfg['date']}, {cfg['machine']}, torch {cfg['torch']}, "
              f"{cfg.get('backend', 'gloo')})")
        print(_markdown(result) if args.markdown else _table(result))
        return
    if "RANK" in os.environ:
        global _ARGS
        _ARGS = args
        _worker(args, os.environ["COMPARE_OUT"])
        return
    import torch
    started = time.time()
    merged = {"rows": [], "skipped": [], "compile": [], "overhead": [], "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.nproc:
            out = os.path.join(tmp, f"n{n}.json")
            env = dict(os.environ, COMPARE_OUT=out, OMP_NUM_THREADS="1",
                       COMPARE_ARGS=json.dumps(list(argv if argv is not None else sys.argv[1:])))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(n), os.path.abspath(__file__)]
            t0 = time.time()
            rc = subprocess.call(cmd, env=env)
            if rc != 0 or not os.path.exists(out):
                print(f"compare.py: the {n}-process run failed (exit code {rc}); see above", file=sys.stderr)
                sys.exit(rc or 1)
            with open(out) as f:
                part = json.load(f)
            for k in ("rows", "skipped", "compile", "overhead"):
                merged[k] += part[k]
            merged["runs"].append({"nproc": n, "seconds": time.time() - t0})
    for c in merged["compile"]:       # compiled / the same step eager: the ratio of their ratios to hand
        pair = {r["variant"]: r for r in merged["rows"]
                if (r["nproc"], r["layout"], r["size"]) == (c["nproc"], c["layout"], c["size"])}
        eager = "functp grad vma" if "compiled grad" in c["variant"] else "functp tape vma"
        if eager in pair and c["variant"] in pair:
            c["vs_eager"] = pair[c["variant"]]["ratio"] / pair[eager]["ratio"]
    import _models as M
    merged["config"] = {
        "command": " ".join(["python benchmarks/compare.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.platform()}",
        "torch": torch.__version__, "backend": "nccl (CUDA)" if args.device == "cuda" else "gloo (CPU)", "nproc": args.nproc,
        "steps": args.steps, "warmup": args.warmup, "sizes": {s: M.SIZES[s] for s in args.sizes},
        "layers": M.LAYERS, "batch": M.BATCH, "seq": M.SEQ, "layouts": args.layouts,
        "compile_backend": args.compile_backend, "seconds": time.time() - started}
    cfg = merged["config"]
    print(f"\n{cfg['command']}  ({cfg['date']}, {cfg['machine']}, torch {cfg['torch']}, gloo)")
    print(f"model: {M.LAYERS} pre-norm MLP blocks, sizes (hidden, ffn) {cfg['sizes']}, "
          f"batch {M.BATCH} x seq {M.SEQ}; {args.steps} timed steps per variant after {args.warmup} warm-up")
    print(_table(merged))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"\nwrote {args.out} ({time.time() - started:.0f} s)")


_ARGS = None

if __name__ == "__main__":
    main()
