"""functp.estimate's predicted step time against the measured one, on this machine.

    python benchmarks/estimate_time.py               # calibrate, then the local programs
    python benchmarks/estimate_time.py --two-hosts   # also dp across two emulated hosts

The profile is `functp.calibrate()` (one thread, as each rank below uses). Each
program runs on 2 gloo processes (one thread each); a step's measured time is the
slowest rank's, the median of 5 steps after 2 warm-ups. The prediction is the
estimate's serial bound (eager gloo collectives block: nothing overlaps), per step:
the estimate of the program with two steps minus the one with one step, which drops
the set-up (building and sharding the parameters). `--two-hosts` needs root and
`../shared/tools/netns_cluster.sh` from the checkout, or `$FUNCTP_NETNS_CLUSTER` (two network namespaces joined by a 1 Gb/s
link): it measures a gloo all-reduce across the link into the profile's `inter`
numbers, then times data parallelism across it, one rank per host. Results go to
benchmarks/results/estimate_time.json.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

import functp
from functp import P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _run import NETNS_CLUSTER  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
NETNS = NETNS_CLUSTER
H, F, B = 1024, 4096, 256        # hidden, ffn width, batch per step


def _mlp_params(h=H, f=F):
    return {"w1": torch.randn(f, h) / h ** 0.5, "w2": torch.randn(h, f) / f ** 0.5}


def _sgd(grad, p, *args):
    def step():
        g = grad(p, *args)
        for k in p:
            p[k].sub_(1e-3 * g[k])
    return step


def tp_mlp(mesh):
    """Megatron MLP over 'x' (column- then row-parallel), torch.func.grad, SGD."""
    specs = {"w1": P("x"), "w2": P(None, "x")}
    p = functp.shard(_mlp_params(), mesh, specs)

    def loss(p, x, y):
        out = functp.psum(torch.relu(x @ p["w1"].T) @ p["w2"].T, "x")
        return ((out - y) ** 2).mean()
    grad = torch.func.grad(functp.shard_map(loss, mesh, in_specs=(specs, P(), P()),
                                            out_specs=P()))
    return _sgd(grad, p, torch.randn(B, H), torch.randn(B, H))


def fsdp_adamw(mesh):
    """FSDP over 'x': every block gathered in the body, AdamW on the blocks."""
    p = functp.shard(_mlp_params(), mesh, P("x"))
    opt = torch.optim.AdamW(list(p.values()), lr=1e-3)
    x, y = torch.randn(B // 2, H), torch.randn(B // 2, H)

    def loss(p, x, y):
        full = {k: functp.all_gather(v, "x", tiled=True) for k, v in p.items()}
        out = torch.relu(x @ full["w1"].T) @ full["w2"].T
        return functp.pmean(((out - y) ** 2).mean(), "x")
    grad = torch.func.grad(functp.shard_map(loss, mesh, in_specs=(P("x"), P("x"), P("x")),
                                            out_specs=P()))

    def step():
        functp.set_grads(p, grad(p, x, y))
        opt.step()
        opt.zero_grad()
    return step


def dp_mlp(mesh, h=H, f=F):
    """Data parallel over 'x': parameters replicated, the gradient all-reduce from vma."""
    p = _mlp_params(h, f)

    def loss(p, x, y):
        out = torch.relu(x @ p["w1"].T) @ p["w2"].T
        return functp.pmean(((out - y) ** 2).mean(), "x")
    grad = torch.func.grad(functp.shard_map(loss, mesh, in_specs=(P(), P("x"), P("x")),
                                            out_specs=P()))
    return _sgd(grad, p, torch.randn(B // 2, h), torch.randn(B // 2, h))


def pipeline(mesh):
    """examples/pipeline.py's hand-written GPipe over 'pp' (8 layers of 1024 in 2 stages,
    4 microbatches of 64), torch.func.grad, SGD."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import pipeline as example
    d, layers = 1024, 8
    specs = {"w": P("pp"), "b": P("pp")}
    p = functp.shard({"w": torch.randn(layers, d, d) / d ** 0.5, "b": torch.zeros(layers, d)},
                     mesh, specs)
    grad = torch.func.grad(functp.shard_map(example.gpipe_by_hand, mesh,
                                            in_specs=(specs, P(), P()), out_specs=P()))
    return _sgd(grad, p, torch.randn(4, 64, d), torch.randn(4, 64, d))


def dp_two_hosts(mesh):
    """Data parallel across the two emulated hosts (a smaller MLP: the 1 Gb/s link)."""
    return dp_mlp(mesh, 512, 1024)


PROGRAMS = {"tp_mlp": tp_mlp, "fsdp_adamw": fsdp_adamw, "dp_mlp": dp_mlp,
            "pipeline": pipeline, "dp_two_hosts": dp_two_hosts}
LOCAL = ["tp_mlp", "fsdp_adamw", "dp_mlp", "pipeline"]


def _mesh(name):
    return functp.make_mesh((functp.process_count(),), ("pp" if name == "pipeline" else "x",))


def program(name, steps):
    """What the estimate runs: the set-up and ``steps`` steps."""
    step = PROGRAMS[name](_mesh(name))
    for _ in range(steps):
        step()


def worker(name):
    """One rank under torchrun: the measured step time (the slowest rank's, median of
    5 after 2 warm-ups), printed as JSON by rank 0. ``link`` times all-reduces
    instead (the calibration of the link between the two hosts)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "link":
        _mesh(name)                   # (joins the process group)
        return _link()
    step = PROGRAMS[name](_mesh(name))
    times = []
    for i in range(7):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times[2:], dtype=torch.float64)
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    if functp.process_index() == 0:
        print("RESULT " + json.dumps({"seconds": statistics.median(slowest.tolist())}))


def _link():
    """gloo all-reduces of 4 B and 4 MiB between the two ranks (fastest of 5 each)."""
    out = {}
    for n in (1, 2 ** 20):
        x = torch.ones(n)
        best = float("inf")
        for _ in range(6):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            torch.distributed.all_reduce(x)
            best = min(best, time.perf_counter() - t0)
        out[n] = best
    if functp.process_index() == 0:
        print("RESULT " + json.dumps({"small": out[1], "large": out[2 ** 20]}))


def _torchrun(name, two_hosts=False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = os.path.abspath(__file__)
    if not two_hosts:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", script, "--worker", name]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    else:
        # one process per host, started without torchrun's agents (their exit
        # barrier across the hosts races when the first host's store goes away)
        procs = [subprocess.Popen(
            ["bash", NETNS, "run", str(node), sys.executable, script, "--worker", name],
            env=dict(env, RANK=str(node), LOCAL_RANK="0", WORLD_SIZE="2",
                     MASTER_ADDR="10.200.0.1", MASTER_PORT="29571"),
            stdout=subprocess.PIPE, text=True) for node in (0, 1)]
        out = "".join(p.communicate()[0] for p in procs)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{name} across the two hosts failed:\n{out}")
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])


def _two_host_profile(cpu):
    """The calibrated profile with one rank per node and the link across measured."""
    from functp.tools._hardware import Hardware, fit_link
    link = _torchrun("link", two_hosts=True)
    inter = fit_link(link["small"], link["large"], 4 * 2 ** 20, 2)
    return Hardware(cpu.name + ", two emulated hosts joined by a 1 Gb/s veth link",
                    cpu.flops, cpu.memory_bandwidth, 1, cpu.intra, inter,
                    dict(cpu.sources, inter="gloo all-reduce of 4 B and 4 MiB across "
                         "netns_cluster.sh's link, fastest of 5"), cpu.memory)


def predict(name, hw) -> float:
    one, two = (functp.estimate(program, 2, name, k, hardware=hw) for k in (1, 2))
    return max(two[r].seconds.serial for r in two.ranks) - max(
        one[r].seconds.serial for r in one.ranks)


def main():
    torch.set_num_threads(1)
    two_hosts = "--two-hosts" in sys.argv[1:]
    cpu = functp.calibrate()
    print(f"calibrated: {json.dumps({k: v for k, v in vars(cpu).items() if k != 'sources'})}")
    runs = [(name, cpu, False) for name in LOCAL]
    if two_hosts:
        runs.append(("dp_two_hosts", _two_host_profile(cpu), True))
    rows = []
    for name, hw, remote in runs:
        measured = _torchrun(name, remote)["seconds"]
        predicted = predict(name, hw)
        rows.append({"program": name, "measured_s": measured, "predicted_s": predicted,
                     "error": predicted / measured - 1})
        print(f"{name:14s} measured {measured * 1e3:8.1f} ms   predicted {predicted * 1e3:8.1f} ms"
              f"   error {100 * (predicted / measured - 1):+6.1f}%", flush=True)
    median = statistics.median(abs(r["error"]) for r in rows)
    print(f"median absolute error: {100 * median:.1f}%")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "estimate_time.json"), "w") as fh:
        json.dump({"profile": {k: v for k, v in vars(cpu).items()}, "rows": rows,
                   "median_abs_error": median}, fh, indent=1, default=str)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    else:
        main()
