"""functp.pipeline against torch.distributed.pipelining on the same model and
microbatches: GPipe, 1F1B, interleaved 1F1B and (interleaved) zero-bubble.

    torchrun --standalone --nproc-per-node 4 benchmarks/pipeline.py [--steps 10]

Each stage is a run of residual tanh layers (D x D, float32); the batch is cut into
M microbatches. Per schedule, both libraries run the same step on the same weights,
alternated (functp then torch, then torch then functp) for ``--steps`` rounds; rank
0 prints each one's median step time, their ratio (functp / torch), each library's
loss (they must agree), functp's table bubble and activations held (rank 0), each
peak memory per stage (MemTracker's total over one more step, and what
functp.estimate predicts; torch's schedules do not run under MemTracker) and
the measured idle fraction of rank 0: 1 - (its stages' forward and backward of the M
microbatches, timed alone, no transfer) / (the step's median), and the messages
each rank posts in a step (sends + receives, cProfile's count of c10d's calls: the
counts are stable where times are not). CPU gloo times are noisy and host-bound at
these sizes: read ratios, not seconds.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist

import functp

D, ROWS, M, LAYERS_PER_VS = 256, 16, 8, 2
STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10


class Block(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, D, D) / D ** 0.5)

    def forward(self, x):
        for i in range(self.w.shape[0]):
            x = x + torch.tanh(x @ self.w[i])
        return x


def mse(y, t):
    return ((y - t) ** 2).mean()


def layers(w, x):
    for i in range(w.shape[0]):
        x = x + torch.tanh(x @ w[i])
    return x


def torch_schedule(name, blocks, pp, rank):
    from torch.distributed import pipelining as tp
    stages = [tp.PipelineStage(b, rank + j * pp, pp * len(blocks), torch.device("cpu"))
              for j, b in enumerate(blocks)]
    cls = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B,
           "interleaved": tp.ScheduleInterleaved1F1B,
           "zero_bubble": tp.ScheduleInterleavedZeroBubble}[name]
    return cls(stages if len(blocks) > 1 or name in ("interleaved", "zero_bubble")
               else stages[0], M, loss_fn=mse), stages


def torch_step(sched, stages, x, y, pp, rank):
    for s in stages:
        s.submod.zero_grad(set_to_none=True)
    losses = []
    kw = {}
    if rank == 0:
        kw["x"] = x
    if rank == pp - 1:
        kw.update(target=y, losses=losses)
    sched.step(*([kw.pop("x")] if "x" in kw else []), **kw)
    return sum(losses) / len(losses) if losses else None


def peak(fn) -> int:
    """MemTracker's peak total over ``fn()`` (its module hooks left out: they cannot
    follow torch.func's wrappers, which functp's stages run under)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Totals(MemTracker):
        def _pre_fw_hook(self, *a):
            pass
        _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook
    with Totals() as mem:
        fn()
    return next(iter(mem.get_tracker_snapshot("peak").values()))["Total"]


def busy(ws, x, y) -> float:
    """This rank's compute alone: each chunk's forward and backward of every
    microbatch, no transfer (median of 5)."""
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for w in ws:
            w = w.detach().requires_grad_()
            for xm, ym in zip(x.chunk(M), y.chunk(M)):
                mse(layers(w, xm), ym).backward()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def messages(fn) -> tuple[int, int]:
    """The point-to-point messages this rank posts in ``fn()``: (sends, receives),
    counted by cProfile as calls of c10d's send and recv (stable where times are not;
    on gloo here each costs ~0.3-0.4 ms of CPU, 4 processes sharing 2 cores)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    calls = {name: n for (_, _, name), (_, n, *_) in pstats.Stats(prof).stats.items()}
    return (calls.get("<built-in method torch._C._distributed_c10d.send>", 0),
            calls.get("<built-in method torch._C._distributed_c10d.recv>", 0))


def main() -> None:
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("pp",))
    pp, rank = mesh.shape["pp"], functp.process_index()
    rows = []
    for name in ("gpipe", "1f1b", "interleaved", "zero_bubble"):
        v = 2 if name in ("interleaved", "zero_bubble") else 1
        fschedule = "zero_bubble" if name == "zero_bubble" else name
        fv = 1 if name == "zero_bubble" else v       # functp's zero-bubble is not looped
        torch.manual_seed(0)
        full = [Block(LAYERS_PER_VS) for _ in range(pp * v)]
        mine = [copy.deepcopy(full[rank + j * pp]) for j in range(v)]
        x, y = torch.randn(M * ROWS, D), torch.randn(M * ROWS, D)
        sched, stages = torch_schedule(name, mine, pp, rank)
        # functp: the same weights (its zero-bubble on pp stages of 2 chunks' layers)
        # (zero-bubble: functp's rank r runs virtual stages 2r and 2r+1 as one stage)
        fw = ([b.w.detach() for b in mine] if fv > 1 else
              torch.cat([full[v * rank + j].w.detach() for j in range(v)]))
        step = functp.pipeline(layers, mesh, microbatches=M, schedule=fschedule,
                               loss_fn=mse, virtual_stages=fv)
        times = {"functp": [], "torch": []}
        for i in range(STEPS + 1):
            order = ("functp", "torch") if i % 2 == 0 else ("torch", "functp")
            for who in order:
                dist.barrier()
                t0 = time.perf_counter()
                if who == "functp":
                    floss, _ = step(fw, x, y)
                else:
                    tloss = torch_step(sched, stages, x, y, pp, rank)
                dt = time.perf_counter() - t0
                if i:                                  # (the first round warms up)
                    times[who].append(dt)
        med = {k: statistics.median(v_) for k, v_ in times.items()}
        dist.barrier()
        fpeak = peak(lambda: step(fw, x, y))
        # (torch's schedules under MemTracker raise in their backward: "A leaf node was
        # passed to _will_engine_execute_node but we are currently running
        # autograd.grad()", its module tracker's gradient hooks against their
        # autograd.grad over the stage's inputs; functp's estimate stands beside it)
        est = functp.estimate(lambda: functp.pipeline(           # (the same shapes)
            layers, functp.make_mesh((pp,), ("pp",)), microbatches=M, schedule=fschedule,
            loss_fn=mse, virtual_stages=fv)(fw, x, y), pp)
        peaks = [None] * pp
        stands = next(r for r in est.ranks if rank in est.alike[r])
        dist.all_gather_object(peaks, (fpeak, est[stands].peak_bytes))
        compute = busy([b.w for b in mine], x, y)
        dist.barrier()
        counts = [None] * pp
        dist.all_gather_object(counts, (messages(lambda: step(fw, x, y)), messages(
            lambda: torch_step(sched, stages, x, y, pp, rank))))
        rows.append((name, med["functp"], med["torch"], floss.item(),
                     None if tloss is None else float(tloss.detach()), step.schedule.bubble,
                     step.peak_saved, peaks, 1 - compute / med["functp"],
                     1 - compute / med["torch"], counts))
    if rank == pp - 1:
        for r in rows:
            print(f"{r[0]:12s} loss functp {r[3]:.6f} torch {r[4]:.6f}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"pp={pp}, M={M}, {ROWS} rows x D={D} per microbatch, "
              f"{LAYERS_PER_VS} layers per virtual stage, {STEPS} rounds, medians")
        print(f"{'schedule':12s} {'functp ms':>10s} {'torch ms':>10s} {'ratio':>6s} "
              f"{'bubble':>7s} {'held':>5s} {'idle functp':>11s} {'idle torch':>10s}")
        for name, f, t, _, _, bubble, held, _, fi, ti, _ in rows:
            print(f"{name:12s} {f * 1e3:10.1f} {t * 1e3:10.1f} {f / t:6.2f} "
                  f"{bubble:7.3f} {held:5d} {fi:11.2f} {ti:10.2f}")
        print("messages a step per rank, sends+receives (functp / torch):")
        for name, counts in [(r[0], r[-1]) for r in rows]:
            print(f"{name:12s} " + "  ".join(f"{sum(f)}/{sum(t)}" for f, t in counts))
        print("functp's peak memory per stage, KiB (MemTracker / functp.estimate):")
        for name, peaks in [(r[0], r[7]) for r in rows]:
            print(f"{name:12s} " + "  ".join(f"{a / 1024:.0f}/{b / 1024:.0f}"
                                             for a, b in peaks))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
