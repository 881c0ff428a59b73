"""functp.estimate against the CUDA allocator: the plain PyTorch tape steps measured on
an H200 (tests/data/gpu_truth_h200.json, its programs in gpu_truth_programs.py), each
estimated here as the cuda program it is, on this CPU-only torch."""
import importlib.util
import functools
import json
import os

import optree
import pytest
import torch

import functp

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
ROWS = json.load(open(os.path.join(HERE, "gpu_truth_h200.json")))["rows"]


def _programs(name: str = "gpu_truth_programs"):
    """A module of tests/data (the programs the GPU rows measured)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# (full sizes, as measured: the 8B-shaped rows trace in about 2 s, the others in 1 s)
@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_gpu_truth_memory_within_5_percent(row):
    program = _programs().program
    est = functp.estimate(lambda: program(row["config"], "cuda")(), 1)
    assert est.device is not None and "cuda" in est.device     # traced for cuda
    assert abs(est.peak_bytes / row["peak_total_bytes"] - 1) < 0.05
    assert abs(est.step_peak_bytes / row["step_peak_above_resident_bytes"] - 1) < 0.05
    assert abs(est.resident_bytes / row["resident_bytes"] - 1) < 0.05
    assert "resident when the step starts" in str(est)


def test_cuda_program_estimated_on_cpu_only_torch():
    """A program written for cuda (a mesh of device_type cuda, tensors made on cuda,
    .cuda(), a module's backward) estimates on a torch without cuda, and says how."""
    def program():
        functp.make_mesh((2,), ("dp",), device_type="cuda")
        with torch.device("cuda"):
            lin = torch.nn.Linear(16, 16)
        x = torch.randn(4, 16).cuda()
        lin(x).sum().backward()
        return lin.weight.grad
    est = functp.estimate(program, 2, hardware="h100-sxm")
    if torch.cuda.is_available():
        pytest.skip("this torch runs cuda: traced as itself")
    assert "cuda program traced on CPU fakes" in est.device
    assert est.flops == 2 * (2 * 4 * 16 * 16)      # forward, weight gradient
    assert est.seconds.host_calls > 0 and est.seconds.bound in ("host", "device")
    assert "-bound" in str(est)


FUNCTP_ROWS = [r for r in json.load(open(os.path.join(HERE, "gpu_truth_h200_functp.json")))["rows"]
               if r["step"] != "plain tape"]
# One step kind per shape (tape), and all three on the 187M shape and on the 8B-shaped
# rows that used to be over-estimated: the 8B SDPA tape step's step peak was 1.49x the
# measured one (func.grad 1.26x, eager func.grad 1.18x) while the estimate ran functp
# code older than the GPU's: a pvary node over the 1-rank axes kept a backward
# temporary alive; since 00156dc (no pvary op over axes of size 1, the code the GPU ran)
# every row is within 5% (the largest, 8B SDPA tape, 1.6%).
_CHOSEN = [r for r in FUNCTP_ROWS
           if r["step"] == "functp tape" or r["name"].startswith(("mid", "8b"))]


@pytest.mark.parametrize("row", _CHOSEN, ids=[f"{r['name']}-{r['step']}" for r in _CHOSEN])
def test_gpu_truth_functp_steps(row):
    """functp's own steps (tape, value_and_grad, torch.func.grad over a 1x1 mesh)
    against the allocator: resident bytes, the step's peak above them and the total
    peak within 5% of the H200's."""
    program = _programs("gpu_truth_functp_programs").program
    est = functp.estimate(lambda: program(row["config"], "cuda", row["step"])(), 1)
    assert abs(est.resident_bytes / row["resident_bytes"] - 1) < 0.05
    step = est.step_peak_bytes / row["step_peak_above_resident_bytes"]
    total = est.peak_bytes / row["peak_total_bytes"]
    assert abs(step - 1) < 0.05 and abs(total - 1) < 0.05, (step, total)


class _Made(torch.utils._python_dispatch.TorchDispatchMode):
    """Weak references to the storages the ops make within it."""

    def __init__(self):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef
        self.weak, self.made = StorageWeakRef, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (a view's or an in-place op's storage is its input's: not made here)
        given = {t.untyped_storage().data_ptr() for t in optree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                st = t.untyped_storage()
                self.made.append((self.weak(st), st.nbytes()))
        return out

    def live_bytes(self) -> int:
        return sum(n for w, n in self.made if not w.expired())


@pytest.mark.parametrize("step", ["functp tape", "functp func.grad"])
def test_functp_step_leaves_no_tensor_allocated(step):
    """What a step leaves allocated is freed when it returns, without waiting for
    Python's cycle collector: the GPU's resident bytes between functp steps were the
    plain step's plus the activations the vma tracker cached (the RMSNorm outputs and
    rotary tables it pvary'd), held by the tracker <-> union rule cycle."""
    pytest.importorskip("transformers")
    import gc
    cfg = dict(hidden=32, inter=64, heads=4, kv=2, vocab=64, layers=1, B=1, T=8,
               attn="sdpa", tie=False)
    program = _programs("gpu_truth_functp_programs").program

    def body():         # (one simulated rank: no process group left in this process,
        run = program(cfg, "cpu", step)      # where an example's shutdown would end it)
        run()
        gc.collect()
        gc.disable()       # as between two GPU steps: no collection in between
        try:
            with _Made() as made:
                out = run()
            del out
            return made.live_bytes()
        finally:
            gc.enable()
    left, = functp.simulate(body, 1)
    assert left == 0, f"{left} bytes of the step's tensors still allocated after it"


# -- host time: the 187M model's steps timed on the H200 (tests/data/gpu_step_h200.json) --

H200_RUNS = json.load(open(os.path.join(HERE, "gpu_step_h200.json")))["runs"]
_TODAY = [run for run in H200_RUNS if run["name"].startswith("after")]   # today's code
_187M = "h1024 L8 4x512"


def _h200():
    """h100-sxm, its host costs as built in, with the H200's measured rates."""
    import dataclasses
    rates = json.load(open(os.path.join(HERE, "gpu_truth_h200.json")))
    flops = rates["measured_bf16_matmul_tflops"] * 1e12
    return dataclasses.replace(
        functp.tools._hardware.HARDWARE["h100-sxm"],
        flops={"float32": flops / 2, "bfloat16": flops},
        memory_bandwidth=rates["measured_copy_bytes_per_s_read_plus_write"] / 2)


def _measured(variant: str) -> list[float]:
    return [next(r["ms"] for r in run["rows"] if r["config"] == _187M
                 and r["variant"] == variant) for run in _TODAY]


@functools.lru_cache(maxsize=None)       # (the plain step: one estimate for the three)
def _predict(variant: str) -> float:
    """The step's time in ms as estimated at the H200's rates (a later step)."""
    progs = _programs("gpu_step_programs")
    est = functp.estimate(lambda: progs.program(progs.CONFIGS[_187M], "cuda", variant,
                                                replay=False), 1,
                          hardware=_h200(), warmup=1)
    assert est.seconds.bound == "host"
    return est.seconds.overlapped * 1e3


@pytest.mark.parametrize("variant", ["functp tape", "functp value_and_grad",
                                     "functp func.grad"])
def test_187m_functp_steps_host_time_within_30_percent_of_the_h200(variant):
    """Issue 40's 187M row: functp's steps of the transformers Llama (hidden 1024, 8
    layers, 4 x 512, bf16), estimated here from their counts (a later step: warmup=1)
    at the GPU profile's host costs, against the H200 runs of the same code. GPU host
    timings vary between runs (the plain tape step took 32.40 and 21.31 ms in the two
    recorded stages), so: the predicted step within 30% of the runs' mean, and its
    ratio to the predicted plain tape step within 30% of each run's own ratio.

    The runs predate the replay of vma decisions (issue 39): the steps are estimated
    as they ran then, every op tracked (``apply.replay = False``). Replayed, the same
    estimate predicts functp's tape step below the plain one (fewer Python calls a
    step: 22.1 against 25.5 ms); no GPU has timed that yet."""
    pytest.importorskip("transformers")
    ms, plain = _predict(variant), _predict("plain tape")
    mean = sum(_measured(variant)) / len(_TODAY)
    assert abs(ms / mean - 1) < 0.30, (ms, _measured(variant))
    for t, p in zip(_measured(variant), _measured("plain tape")):
        assert abs((ms / plain) / (t / p) - 1) < 0.30, (ms / plain, t / p)
