"""Hardware profiles and the time model of :func:`functp.estimate`.

A profile is data: peak matmul throughput per dtype, memory bandwidth, and for the
links within a node and across nodes a latency (alpha, seconds) and a bandwidth
(beta, bytes per second per rank, one direction), each number with where it comes
from. The model is the textbook one, and its answers are predictions, not
measurements:

- an operator takes ``max(flops / peak, bytes read and written / memory bandwidth)``
  (roofline);
- a collective of ``p`` ranks over ``n`` bytes takes what its algorithm needs (ring:
  ``(p-1)`` steps of ``n/p`` for all-gather / reduce-scatter / all-to-all, twice that
  for all-reduce; tree all-reduce: ``2 log2 p`` steps of ``n``; the faster of ring and
  tree is taken, as NCCL does); each step costs ``alpha + bytes / beta`` over the
  slowest link the group spans (across nodes when its ranks are in more than one).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..runtime._errors import ShardingError

__all__ = ["Hardware", "HARDWARE", "calibrate", "hardware_profile", "op_seconds",
           "collective_seconds", "fit_link"]


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. ``flops``: peak dense FLOP/s by dtype name
    (``"float32"``, ``"bfloat16"``, ...); ``memory_bandwidth``: bytes/s;
    ``intra`` / ``inter``: ``(alpha seconds, beta bytes/s per rank and direction)``
    within a node of ``ranks_per_node`` and across nodes; ``sources``: where each
    number comes from; ``memory``: bytes one rank can hold (the budget
    :func:`functp.rank_meshes` fits candidates in; 0: unknown); ``host_call``:
    seconds the host spends per operator call of an eager step (0: not counted);
    ``host_python``: seconds per Python call of the step (a Python function's or a C
    function's called from Python: the model's, torch's and functp's own code)."""
    name: str
    flops: dict
    memory_bandwidth: float
    ranks_per_node: int
    intra: tuple[float, float]
    inter: tuple[float, float]
    sources: dict = field(default_factory=dict)
    memory: float = 0
    host_call: float = 0.0
    host_python: float = 0.0

    def peak(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops["float32"])


_H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (SXM5), nvidia.com/en-us/data-center/h100"
_A100_DS = "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), nvidia.com/en-us/data-center/a100"

# seconds the host of a GPU spends per operator call and per Python call of an eager
# step: solved from the two plain PyTorch steps of a transformers Llama (hidden 1024,
# 8 layers, 4 x 512 tokens, bf16) timed on an H200 host (torch 2.11), both host-bound:
# the tape step and torch.func.grad of functional_call, each the mean of the five
# recorded runs (26.32 and 39.27 ms: tests/data/gpu_step_h200.json), for the operator
# and Python calls functp.estimate(..., warmup=1) counts in a later step of those
# programs (2010 and 5887; 1770 and 13462: benchmarks/estimate_host.py prints the
# solve). functp's own steps are not used.
_GPU_HOST_CALL = 7.40e-6
_GPU_HOST_PYTHON = 1.944e-6
_GPU_HOST_SOURCE = ("solved from two host-bound plain steps of a 187M transformers Llama "
                    "on an H200 host (torch 2.11): tape 26.32 ms, torch.func.grad 39.27 ms "
                    "(means of five runs, tests/data/gpu_step_h200.json), and their "
                    "operator and Python calls as functp.estimate(..., warmup=1) counts them")


def _datasheet(sheet: str, hbm: str, nvlink: str, nic: str, memory: str) -> dict:
    """A built-in profile's ``sources``: its datasheet, and the network card's; the
    latencies are the order of magnitude NCCL's tests show (µs), not a datasheet's."""
    return {"flops": sheet, "memory_bandwidth": f"{sheet} ({hbm})",
            "intra": f"{sheet} ({nvlink}); latency: NCCL tests, order of µs",
            "inter": f"{nic}; latency order of µs", "memory": f"{sheet} ({memory})",
            "host_call": _GPU_HOST_SOURCE, "host_python": _GPU_HOST_SOURCE}


HARDWARE: dict[str, Hardware] = {
    "h100-sxm": Hardware(
        "H100 SXM, NVLink 4 within 8-GPU nodes, 400 Gb/s InfiniBand (NDR) per GPU",
        # dense (no sparsity) tensor-core peaks; float32 runs as TF32 on tensor cores
        {"float64": 67e12, "float32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12,
         "float8_e4m3fn": 1978.9e12},
        3.35e12, 8,
        (3e-6, 450e9),       # NVLink 4: 900 GB/s bidirectional per GPU
        (5e-6, 50e9),        # one 400 Gb/s NDR port per GPU
        _datasheet(_H100_DS, "HBM3 3.35 TB/s", "NVLink 900 GB/s",
                   "NVIDIA ConnectX-7 NDR 400 Gb/s InfiniBand", "80 GB HBM3"),
        80 * 2 ** 30, _GPU_HOST_CALL, _GPU_HOST_PYTHON),
    "a100": Hardware(
        "A100 SXM 80GB, NVLink 3 within 8-GPU nodes, 200 Gb/s InfiniBand (HDR) per GPU",
        {"float64": 19.5e12, "float32": 156e12, "bfloat16": 312e12, "float16": 312e12},
        2.039e12, 8,
        (3e-6, 300e9),       # NVLink 3: 600 GB/s bidirectional per GPU
        (5e-6, 25e9),        # one 200 Gb/s HDR port per GPU
        _datasheet(_A100_DS, "HBM2e 2,039 GB/s", "NVLink 600 GB/s",
                   "NVIDIA ConnectX-6 HDR 200 Gb/s InfiniBand", "80 GB HBM2e"),
        80 * 2 ** 30, _GPU_HOST_CALL, _GPU_HOST_PYTHON),
}


def hardware_profile(hardware) -> Hardware:
    """A :class:`Hardware` from itself or from the name of a built-in profile."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware in HARDWARE:
        return HARDWARE[hardware]
    raise ShardingError(
        f"functp.estimate: unknown hardware {hardware!r}; give one of "
        f"{sorted(HARDWARE)} or a functp Hardware profile")


def op_seconds(hw: Hardware, flops: int, nbytes: int, dtype: str) -> float:
    """Roofline time of one operator: bound by compute or by memory traffic."""
    return max(flops / hw.peak(dtype), nbytes / hw.memory_bandwidth)


def collective_seconds(hw: Hardware, op: str, nbytes: int, members: tuple[int, ...]) -> float:
    """Alpha-beta time of one collective. ``nbytes``: this rank's input buffer (as
    ``comm_log`` records it); ``members``: the global ranks of its group."""
    p = len(members)
    if p <= 1:
        return 0.0
    nodes = {r // hw.ranks_per_node for r in members}
    alpha, beta = hw.inter if len(nodes) > 1 else hw.intra
    if op == "all_reduce":
        ring = 2 * (p - 1) * (alpha + nbytes / p / beta)
        tree = 2 * math.ceil(math.log2(p)) * (alpha + nbytes / beta)
        return min(ring, tree)
    if op == "all_gather":          # every rank receives p - 1 blocks of nbytes
        return (p - 1) * (alpha + nbytes / beta)
    if op in ("reduce_scatter", "all_to_all"):   # p - 1 blocks of nbytes / p
        return (p - 1) * (alpha + nbytes / p / beta)
    return alpha + nbytes / beta    # permute: one send and one receive


def fit_link(small: float, large: float, large_bytes: int, ranks: int) -> tuple[float, float]:
    """``(alpha, beta)`` of a link from the times of a ring all-reduce of a few bytes
    (``small`` seconds: latency only) and of ``large_bytes`` (``large`` seconds):
    the inverse of :func:`collective_seconds`' ring formula."""
    steps = 2 * (ranks - 1)
    alpha = small / steps
    return alpha, large_bytes / ranks / max(large / steps - alpha, 1e-12)


def _best(f, repeat: int) -> float:
    """The fastest of ``repeat`` timings of ``f()``, after one warm-up call."""
    import time
    f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def _matmul_flops(m: int, best) -> dict[str, float]:
    """FLOP/s of float32 and float64 matmuls on this host: a step's matmuls are
    rarely square, so a square one, a wide and a tall one of the same work (FLOPs
    over the total time)."""
    import torch
    shapes = [(m, m, m), (m // 4, m, 4 * m), (m // 4, 4 * m, m)]
    flops = {}
    for dtype in (torch.float32, torch.float64):
        pairs = [(torch.randn(a, b, dtype=dtype), torch.randn(b, c, dtype=dtype))
                 for a, b, c in shapes]
        seconds = sum(best(lambda x=x, y=y: x @ y) for x, y in pairs)
        flops[str(dtype).removeprefix("torch.")] = sum(2 * a * b * c
                                                       for a, b, c in shapes) / seconds
    return flops


def _gloo_link(ranks: int, best) -> tuple[float, float]:
    """(latency, bandwidth) of a gloo all-reduce between ``ranks`` simulated ranks,
    fitted to one of 4 B and one of 4 MiB (a collective ends when its slowest rank's
    does)."""
    import torch

    from ..ops import _collectives
    from ..mesh import _mesh
    from ..mapping import _shard_map
    from . import _simulate
    from ..mesh._spec import P
    small_n, large_n = 1, 2 ** 20                                  # 4 B and 4 MiB

    def timings():
        mesh = _mesh.make_mesh((ranks,), ("x",))
        reduce = _shard_map.shard_map(lambda v: _collectives.psum(v, "x"), mesh,
                                      in_specs=P("x"), out_specs=P("x"), check_vma=False)
        return [best(lambda: reduce(torch.ones(n))) for n in (small_n, large_n)]
    small, large = (max(ts) for ts in zip(*_simulate.simulate(timings, ranks, check=False)))
    return fit_link(small, large, large_n * 4, ranks)


def calibrate(*, matmul_size: int = 1024, ranks: int = 2, repeat: int = 5,
              host_steps=None) -> Hardware:
    """Measures this machine into a :class:`Hardware` profile: matmul throughput
    (float32 and float64), memory bandwidth (a large add into a fresh tensor, as
    eager ops write), and the latency and
    bandwidth of a gloo all-reduce between ``ranks`` ranks of
    :func:`functp.simulate` (all counted as one node).

    The host's costs (``host_call`` per operator, ``host_python`` per Python call)
    are fitted to eager steps timed on this host and counted: by default two steps
    of a tiny decoder written in torch (a tape step and a ``torch.func.grad`` step),
    or ``host_steps``, steps of your own model (plain PyTorch steps are enough: the
    costs then predict functp's steps of the same model from their counts; the
    per-call costs differ between models' mixes of operators and Python, by up to
    ~25% between the tiny decoder and a transformers Llama here).

    **Arguments:** ``matmul_size`` – the side of the square matmul timed (and the
    inner size of the wide and tall ones);
    ``ranks`` – ranks in the all-reduces; ``repeat`` – timings per measurement (the
    fastest is kept); ``host_steps`` – zero-argument callables, each one eager step
    (at least two, with different shares of Python calls), or None.

    **Returns:** a ``Hardware`` named after this machine, its ``sources`` saying how
    each number was measured. Example::

        cpu = functp.calibrate()
        functp.estimate(program, 2, hardware=cpu).seconds
    """
    import platform

    import torch

    def best(f) -> float:
        return _best(f, repeat)

    m = matmul_size
    flops = _matmul_flops(m, best)
    # an eager op writes a fresh output (new pages, touched for the first time): an
    # add of two 64 MiB tensors, not a copy into a buffer already there
    big = torch.empty(16 * 2 ** 20, dtype=torch.float32).fill_(1)
    bandwidth = 3 * big.numel() * 4 / best(lambda: big + big)
    alpha, beta = _gloo_link(ranks, best)
    where = f"functp.calibrate() on {platform.node()}"
    host_call, host_python = _host_costs(host_steps)
    return Hardware(
        f"this machine ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, gloo)", flops, bandwidth, 1 << 30,
        (alpha, beta), (alpha, beta),
        {"flops": f"{where}: best of {repeat} of {m}x{m}x{m}, {m // 4}x{m}x{4 * m} and "
                  f"{m // 4}x{4 * m}x{m} matmuls",
         "memory_bandwidth": f"{where}: an add of two 64 MiB tensors into a new one",
         "intra": f"{where}: gloo all-reduce of 4 B (latency) and 4 MiB (bandwidth) "
                  f"over {ranks} simulated ranks",
         "inter": "as intra: one machine",
         "memory": f"{where}: physical memory (os.sysconf), shared by the ranks",
         "host_call": f"{where}: " + (
             f"{len(host_steps)} steps given (host_steps=)" if host_steps else
             "a tape step and a torch.func.grad step of a tiny decoder (4 blocks, "
             "width 64, 8 tokens)") + ", timed, their operator and Python calls "
             "counted, the per-call costs fitted to them (least squares)",
         "host_python": f"{where}: as host_call"},
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), host_call, host_python)


def _host_costs(steps=None) -> tuple[float, float]:
    """Seconds the host spends per operator call and per Python call of an eager
    step: ``steps`` (default: a tape step and ``torch.func.grad`` of
    ``functional_call`` of :class:`_TinyDecoder`, which re-parametrizes the module
    in Python: two shares of Python), each timed (the median of 20 after a warm-up)
    and counted (operators torch dispatches; Python calls as
    :class:`~functp.tools._host_count.PyCalls` counts them, as the estimate does),
    the two costs the least-squares fit to them."""
    import statistics
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ._host_count import PyCalls

    if steps is None:
        torch.manual_seed(0)
        net = _TinyDecoder()
        x = torch.randint(64, (1, 8))
        params = {k: v.detach() for k, v in net.named_parameters()}

        def tape():
            net(x).backward()
            net.zero_grad(set_to_none=True)
        grad = torch.func.grad(lambda p: torch.func.functional_call(net, p, (x,)))
        steps = (tape, lambda: grad(params))
    if len(steps) < 2:
        raise ShardingError(f"functp.calibrate: host_steps needs at least two steps "
                            f"(with different shares of Python calls), got {len(steps)}")

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func.namespace != "prim"
            return func(*args, **(kwargs or {}))

    rows = []
    for step in steps:
        step()
        Count.calls = 0
        with Count():
            step()
        with PyCalls() as py:
            step()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        rows.append((Count.calls, py.total + py.builtin, statistics.median(times)))
    # least squares of t = ops * per_op + python * per_py (normal equations)
    soo = sum(o * o for o, _, _ in rows)
    spp = sum(p * p for _, p, _ in rows)
    sop = sum(o * p for o, p, _ in rows)
    sot = sum(o * t for o, _, t in rows)
    spt = sum(p * t for _, p, t in rows)
    det = soo * spp - sop * sop
    per_op = (sot * spp - spt * sop) / det if det else 0.0
    per_py = (soo * spt - sop * sot) / det if det else 0.0
    if per_op <= 0 or per_py <= 0:     # (timing noise, or alike steps): all per operator
        return sum(t for *_, t in rows) / sum(o for o, _, _ in rows), 0.0
    return per_op, per_py


class _TinyDecoder(__import__("torch").nn.Module):
    """The calibration's step: a decoder shaped as the models estimated are (an
    embedding, 4 blocks of RMS norm, attention with rotary embeddings and a SwiGLU
    MLP, a head, the cross-entropy of the shifted tokens), its kernels tiny (width
    64, 8 tokens): an operator mix of views, elementwise ops and matmuls as theirs,
    not of one kind (the cost per operator differs by kind, ~1 to ~8 µs here)."""

    def __init__(self, width: int = 64, heads: int = 4, layers: int = 4, vocab: int = 64):
        import torch
        super().__init__()
        nn = torch.nn
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            norm1=nn.RMSNorm(width), qkv=nn.Linear(width, 3 * width, bias=False),
            out=nn.Linear(width, width, bias=False), norm2=nn.RMSNorm(width),
            gate=nn.Linear(width, 2 * width, bias=False), up=nn.Linear(width, 2 * width, bias=False),
            down=nn.Linear(2 * width, width, bias=False))) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    @staticmethod
    def _rotate(x, cos, sin):
        import torch
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(self, ids):
        import torch
        F = torch.nn.functional
        b, t = ids.shape
        h = self.embed(ids)
        d = h.shape[-1] // self.heads
        pos = torch.arange(t, dtype=torch.float32)[:, None] / 10000 ** (
            torch.arange(0, d, 2, dtype=torch.float32) / d)
        cos, sin = torch.cat((pos, pos), -1).cos(), torch.cat((pos, pos), -1).sin()
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](h)).view(b, t, 3, self.heads, d).unbind(2)
            q, k, v = (y.transpose(1, 2) for y in (q, k, v))
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + blk["out"](a.transpose(1, 2).reshape(b, t, -1))
            g = blk["norm2"](h)
            h = h + blk["down"](F.silu(blk["gate"](g)) * blk["up"](g))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
