"""FSDP across two emulated hosts: functp's FSDP plan family against torch's
``fully_shard`` (FSDP2), and against the computation alone.

    python benchmarks/fsdp_overlap.py              # two hosts: netns_cluster.sh up, run, down (root)
    python benchmarks/fsdp_overlap.py --local      # 2 local gloo processes instead (no link limit)

The hosts, the model and the rounds are those of ``overlap.py`` (issue 25's 8 x
(Linear(1024, 1024) + ReLU), MSE loss, an SGD update, ``--batch`` rows per host; each
round runs every variant once after a barrier; medians of rank 0). Each parameter is
stored as its half over the ``fsdp`` axis of the two hosts:

- FSDP2: ``fully_shard`` on each Linear and on the root, ``reshard_after_forward=False``
  (the gathered weights kept for the backward, as functp keeps them) and ``=True``
  (freed after the forward, gathered again in the backward); tape autograd;
- functp: ``parallelize(model, mesh, {"fsdp": "auto"})`` in one shard_map'd loss
  (``pmean`` over ``fsdp``), through tape autograd, ``torch.func.grad`` and
  ``functp.value_and_grad``; "no prefetch": the plan's ``FullyShard`` with
  ``prefetch=False`` (each module gathers its weights in its own pre-hook); "no
  overlap": ``functp.set_overlap(enabled=False)`` (the reduce-scatters waited on where
  the backward issues them); "free_full_weight": ``FullyShard(2, free=True)`` (the
  gathered weights freed after the forward and gathered again in the tape backward,
  as ``reshard_after_forward=True``);
- compute: the unsharded step on the host's batch, with no communication.

Ratios are to FSDP2 with ``reshard_after_forward=False``; functp's collectives are
counted per step with ``comm_log``. Writes ``results/fsdp_overlap_b<batch>.json``.
(A separate script from ``overlap.py``, which measures data parallelism: the two
share the model, the hosts and the timing loop, not their variants.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from overlap import CLUSTER, LR, WIDTH, make_model, mse  # noqa: E402


def _sgd(params, grads) -> None:
    with torch.no_grad():
        torch._foreach_add_(params, grads, alpha=-LR)


def _tape_step(model, x, y):
    params = list(model.parameters())

    def step():
        for q in params:
            q.grad = None
        mse(model(x), y).backward()
        _sgd(params, [q.grad for q in params])
    return step


def _fsdp2(x, y, reshard: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return _tape_step(model, x, y)


def _functp(x, y, prefetch: bool = True, free: bool = False):
    """functp's FSDP family: (tape step, torch.func.grad step, value_and_grad step)."""
    import functp
    from functp import P
    from functp import FullyShard
    n = dist.get_world_size()
    mesh = functp.make_mesh((n,), ("fsdp",))
    family = "auto" if prefetch and not free else FullyShard(n, prefetch=prefetch, free=free)
    apply, params, specs = functp.parallelize(make_model(), mesh, {"fsdp": family})
    loss = functp.shard_map(lambda p, x, y: functp.pmean(mse(apply(p, x), y), "fsdp"),
                            mesh, in_specs=(specs, P("fsdp"), P("fsdp")), out_specs=P())
    fp = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    leaves = list(fp.values())
    fd = {k: v.detach() for k, v in fp.items()}     # (the same memory, for torch.func)

    def tape():
        for q in leaves:
            q.grad = None
        loss(fp, x, y).backward()
        _sgd(leaves, [q.grad for q in leaves])

    def func_grad():
        _sgd(leaves, list(torch.func.grad(loss)(fd, x, y).values()))

    def vag():
        _sgd(leaves, list(functp.value_and_grad(loss)(fd, x, y)[1].values()))
    return tape, func_grad, vag


def _no_overlap(step):
    import functp

    def run():
        prev = functp.set_overlap(enabled=False)
        try:
            step()
        finally:
            functp.set_overlap(**prev)
    return run


def variants(x, y) -> dict:
    """name -> (a step, functp's collectives per step or None)."""
    import functp
    out = {"compute alone": (_tape_step(make_model(), x, y), 0),
           "FSDP2, reshard_after_forward=False": (_fsdp2(x, y, False), None),
           "FSDP2, reshard_after_forward=True": (_fsdp2(x, y, True), None)}
    tape, func_grad, vag = _functp(x, y, True)
    tape0, func_grad0, _ = _functp(x, y, prefetch=False)
    tape_free, _, vag_free = _functp(x, y, free=True)
    for name, step in (("functp tape", tape), ("functp torch.func.grad", func_grad),
                       ("functp.value_and_grad", vag),
                       ("functp tape, no prefetch", tape0),
                       ("functp torch.func.grad, no prefetch", func_grad0),
                       ("functp tape, free_full_weight", tape_free),
                       ("functp.value_and_grad, free_full_weight", vag_free),
                       ("functp tape, no overlap", _no_overlap(tape))):
        step()                       # the first call checks the modules' order
        with functp.comm_log() as log:
            step()
        out[name] = (step, len(log))
    for name, (step, _) in out.items():
        if name.startswith("FSDP2"):
            step()                   # (FSDP2's lazy init, outside the timed rounds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    args, _ = ap.parse_known_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1 + dist.get_rank())     # each host its own batch
    x = torch.randn(args.batch, WIDTH, generator=g)
    y = torch.randn(args.batch, WIDTH, generator=g)
    steps = variants(x, y)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, (step, _) in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["FSDP2, reshard_after_forward=False"]
    res = {"batch_per_host": args.batch, "rounds": args.rounds,
           "hosts": dist.get_world_size(), "torch": torch.__version__,
           "rows": {k: {"median_s": med[k], "vs_fsdp2": med[k] / base,
                        "collectives_per_step": steps[k][1], "times_s": times[k]}
                    for k in steps}}
    if dist.get_rank() == 0:
        print(f"batch {args.batch} per host, {dist.get_world_size()} hosts, "
              f"median of {args.rounds} interleaved rounds")
        print(f"{'step':38s} {'median ms':>10s} {'vs FSDP2':>9s} {'collectives':>12s}")
        for k, r in res["rows"].items():
            c = r["collectives_per_step"]
            print(f"{k:38s} {1e3 * r['median_s']:10.1f} {r['vs_fsdp2']:8.2f}x "
                  f"{'-' if c is None else c:>12}")
    from _run import save_and_leave
    save_and_leave(f"fsdp_overlap_b{args.batch}", res)


def two_hosts(extra: list[str], rate: str) -> None:
    """Brings up the two emulated hosts, runs one process on each, takes them down
    (as ``overlap.py`` does, with this script)."""
    import fcntl
    lock = open("/tmp/functp-netns.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit("the emulated hosts are in use (/tmp/functp-netns.lock): try later")
    up = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    if "fa" in up or "fb" in up:
        raise SystemExit(f"the emulated hosts are up already (another run's?); when no one "
                         f"uses them: {CLUSTER} down")
    subprocess.run([CLUSTER, "up", rate], check=True)
    try:
        cmd = lambda node: [CLUSTER, "run", str(node), sys.executable, "-m",
                            "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                            "--node-rank", str(node), "--master-addr", "10.200.0.1",
                            "--master-port", "29532", os.path.abspath(__file__), *extra]
        procs = [subprocess.Popen(cmd(node)) for node in (0, 1)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a host failed: exit codes {codes}")
    finally:
        subprocess.run([CLUSTER, "down"], check=False)


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    elif "--local" in sys.argv:
        from _run import main_or_launch
        main_or_launch(main, 2, __file__, *[a for a in sys.argv[1:] if a != "--local"])
    else:
        rate = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--rate=")),
                    "1gbit")
        two_hosts([a for a in sys.argv[1:] if not a.startswith("--rate=")], rate)
