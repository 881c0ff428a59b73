"""Data parallelism across two emulated hosts: how much of the gradient all-reduce the
step hides behind the backward.

    python benchmarks/overlap.py              # two hosts: netns_cluster.sh up, run, down (root)
    python benchmarks/overlap.py --local      # 2 local gloo processes instead (no link limit)

Two "hosts" are two network namespaces joined by a rate-limited link
(``../shared/tools/netns_cluster.sh`` from the checkout, or ``$FUNCTP_NETNS_CLUSTER``;
1 Gbit by default), one process each,
``torchrun --nnodes 2``. The model is issue 25's: 8 x (Linear(1024, 1024) + ReLU), 32
MiB of float32 gradients, an MSE loss, a batch of ``--batch`` rows per host, and an SGD
update. Every variant runs the same step; rounds interleave the variants (each round
runs each once, after a barrier), and the medians are rank 0's:

- hand: tape backward, then one all-reduce of all gradients flattened (no overlap);
- DDP: ``DistributedDataParallel`` (25 MiB buckets, launched during the backward);
- DDP, 4 MiB buckets: ``bucket_cap_mb=4`` (one layer's weight a bucket);
- functp tape / ``torch.func.grad`` / ``functp.value_and_grad``: one shard_map'd loss
  (parameters ``P()``, batch ``P("dp")``, ``pmean``), gradient buckets as functp makes
  them (1 MiB then 25 MiB, as DDP), or 4 MiB ones (``functp.set_overlap``); "no
  overlap": the same with ``functp.set_overlap(enabled=False)``;
- functp ..., inputs' order: the buckets kept in the inputs' order (never rebuilt
  in the order the first backward's gradients came in);
- compute: the step with no communication (the floor);
- with ``FUNCTP_BUCKETS="1/4,4/4"`` (first/rest MiB pairs): functp tape and
  ``torch.func.grad`` with those buckets (how the default was chosen, issue 55).

Ratios are to the hand step; collectives are counted per step (functp's comm_log,
DDP's through a counting comm hook). Writes ``results/overlap.json``.
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
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _run import NETNS_CLUSTER as CLUSTER  # noqa: E402  (after the sys.path line above)
WIDTH, LAYERS, LR = 1024, 8, 1e-3
SMALL_MB = 4.0          # the smaller buckets also measured: one layer's weight each


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def forward(p: dict, x: torch.Tensor) -> torch.Tensor:
    """The model as a function of its parameter dict (the same addmm kernels)."""
    for i in range(LAYERS):
        x = torch.relu(nn.functional.linear(x, p[f"{2 * i}.weight"], p[f"{2 * i}.bias"]))
    return x


def mse(out, y):
    return ((out - y) ** 2).mean()


def sgd(params, grads) -> None:
    with torch.no_grad():
        torch._foreach_add_(params, grads, alpha=-LR)


def tape_step(module, x, y):
    """A tape step of ``module`` (the plain model, a DDP, an FSDP2 model) on ``(x, y)``."""
    params = list(module.parameters())

    def step():
        for q in params:
            q.grad = None
        mse(module(x), y).backward()
        sgd(params, [q.grad for q in params])
    return step


def functp_steps(loss, params: dict, x, y):
    """A shard_map'd ``loss(params, x, y)`` as three update steps on its own copy of
    ``params``: (tape autograd, ``torch.func.grad``, ``functp.value_and_grad``)."""
    import functp
    fp = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    leaves = list(fp.values())
    # (torch.func differentiates tensors that need no tape gradient: the same memory)
    fd = {k: v.detach() for k, v in fp.items()}

    def tape():
        for q in leaves:
            q.grad = None
        loss(fp, x, y).backward()
        sgd(leaves, [q.grad for q in leaves])

    def func_grad():
        sgd(leaves, list(torch.func.grad(loss)(fd, x, y).values()))

    def vag():
        sgd(leaves, list(functp.value_and_grad(loss)(fd, x, y)[1].values()))
    return tape, func_grad, vag


def variants(x, y):
    """name -> (a step, collectives per step)."""
    import functp
    from functp import P
    n = dist.get_world_size()
    out = {}

    model = make_model()
    params = list(model.parameters())

    out["compute alone"] = (tape_step(model, x, y), 0)

    def hand():
        for q in params:
            q.grad = None
        mse(model(x), y).backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        dist.all_reduce(flat)
        flat /= n
        pieces = flat.split([q.numel() for q in params])
        sgd(params, [f.view_as(q) for f, q in zip(pieces, params)])
    out["hand (1 all-reduce)"] = (hand, 1)

    # counted on a second DDP with a counting comm hook (the timed one keeps DDP's own
    # C++ all-reduce); DDP rebuilds its buckets after the first step: count the second
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    calls = [0]

    def counting(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    def ddp(**options):
        counted = nn.parallel.DistributedDataParallel(make_model(), **options)
        counted.register_comm_hook(dist.group.WORLD, counting)
        tape_step(counted, x, y)()
        calls[0] = 0
        tape_step(counted, x, y)()
        step = tape_step(nn.parallel.DistributedDataParallel(make_model(), **options), x, y)
        step()
        return step, calls[0]
    out["DDP"] = ddp()
    out[f"DDP, {SMALL_MB:g} MiB buckets"] = ddp(bucket_cap_mb=SMALL_MB)

    mesh = functp.make_mesh((n,), ("dp",))
    loss = functp.shard_map(lambda p, x, y: functp.pmean(mse(forward(p, x), y), "dp"),
                            mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P())
    tape, func_grad, vag = functp_steps(loss, make_model().state_dict(), x, y)

    def setting(step, **kw):
        def run():
            prev = functp.set_overlap(**kw)
            try:
                step()
            finally:
                functp.set_overlap(**prev)
        return run

    small = dict(bucket_mb=SMALL_MB, first_bucket_mb=SMALL_MB)
    from functp.ops import _buckets

    def inputs_order(step):
        # buckets in the inputs' (optree's) order, never rebuilt in arrival order
        def run():
            _buckets.REBUILD = False
            try:
                step()
            finally:
                _buckets.REBUILD = True
        return run

    # other buckets to choose from (issue 55): "FIRST/REST" MiB pairs in FUNCTP_BUCKETS,
    # each exactly those sizes (min_buckets=1: not cut smaller by the default's rule)
    candidates = []
    for pair in filter(None, os.environ.get("FUNCTP_BUCKETS", "").split(",")):
        first, rest = (float(v) for v in pair.split("/"))
        kw = dict(first_bucket_mb=first, bucket_mb=rest, min_buckets=1)
        candidates += [(f"functp tape, {first:g}+{rest:g} MiB", setting(tape, **kw)),
                       (f"functp func.grad, {first:g}+{rest:g} MiB", setting(func_grad, **kw))]
    for name, step in (("functp tape", tape), ("functp torch.func.grad", func_grad),
                       ("functp.value_and_grad", vag),
                       (f"functp tape, {SMALL_MB:g} MiB buckets", setting(tape, **small)),
                       (f"functp torch.func.grad, {SMALL_MB:g} MiB buckets",
                        setting(func_grad, **small)),
                       (f"functp.value_and_grad, {SMALL_MB:g} MiB buckets", setting(vag, **small)),
                       ("functp tape, inputs' order", inputs_order(tape)),
                       (f"functp tape, {SMALL_MB:g} MiB, inputs' order",
                        inputs_order(setting(tape, **small))),
                       (f"functp func.grad, {SMALL_MB:g} MiB, inputs' order",
                        inputs_order(setting(func_grad, **small))),
                       ("functp tape, no overlap", setting(tape, enabled=False)),
                       ("functp torch.func.grad, no overlap", setting(func_grad, enabled=False)),
                       *candidates):
        with functp.comm_log() as log:
            step()
        out[name] = (step, len(log))
    return out


def measure(variants, base: str, ratio: str, name: str) -> None:
    """The timed run both two-host scripts make, on each host: ``variants(x, y)``
    ({label: (step, collectives per step)}) on this host's batch, every variant once
    per round after a barrier, medians relative to the ``base`` row (as ``ratio`` in
    the JSON), printed by rank 0 and saved as ``results/<name>_b<batch>.json``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated substrings of the rows "
                    "to time (the base row always)")
    args, _ = ap.parse_known_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1 + dist.get_rank())     # each host its own batch
    x = torch.randn(args.batch, WIDTH, generator=g)
    y = torch.randn(args.batch, WIDTH, generator=g)
    steps = variants(x, y)
    if args.only:       # (a shorter run: the rows naming one of these, and the base)
        steps = {k: v for k, v in steps.items()
                 if k == base or any(w in k for w in args.only.split(","))}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for label, (step, _) in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"batch_per_host": args.batch, "rounds": args.rounds,
           "hosts": dist.get_world_size(), "torch": torch.__version__,
           "rows": {k: {"median_s": med[k], ratio: med[k] / med[base],
                        "collectives_per_step": steps[k][1], "times_s": times[k]}
                    for k in steps}}
    if dist.get_rank() == 0:
        print(f"batch {args.batch} per host, {dist.get_world_size()} hosts, "
              f"median of {args.rounds} interleaved rounds")
        print(f"{'step':38s} {'median ms':>10s} {ratio.replace('_', ' '):>9s} "
              f"{'collectives':>12s}")
        for k, r in res["rows"].items():
            c = r["collectives_per_step"]
            print(f"{k:38s} {1e3 * r['median_s']:10.1f} {r[ratio]:8.2f}x "
                  f"{'-' if c is None else c:>12}")
    from _run import save_and_leave
    save_and_leave(f"{name}_b{args.batch}", res)


def main() -> None:
    measure(variants, "hand (1 all-reduce)", "vs_hand", "overlap")


def two_hosts(script: str, port: int, extra: list[str], rate: str) -> None:
    """Brings up the two emulated hosts, runs ``script`` once on each (torchrun, one
    process per host, rendezvous on ``port``), takes them down. Holds
    /tmp/functp-netns.lock meanwhile (another session's run may use them); gives up at
    once if it is held, rather than wait while holding the caller's locks."""
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
                            "--master-port", str(port), os.path.abspath(script), *extra]
        procs = [subprocess.Popen(cmd(node)) for node in (0, 1)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a host failed: exit codes {codes}")
    finally:
        subprocess.run([CLUSTER, "down"], check=False)


def cli(main, script: str, port: int) -> None:
    """A two-host script's command line: under torchrun (``RANK`` set) ``main``;
    ``--local``: 2 local gloo processes; else the two emulated hosts (``--rate=``)."""
    if "RANK" in os.environ:
        main()
    elif "--local" in sys.argv:
        from _run import main_or_launch
        main_or_launch(main, 2, script, *[a for a in sys.argv[1:] if a != "--local"])
    else:
        rate = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--rate=")),
                    "1gbit")
        two_hosts(script, port, [a for a in sys.argv[1:] if not a.startswith("--rate=")], rate)


if __name__ == "__main__":
    cli(main, __file__, 29531)
