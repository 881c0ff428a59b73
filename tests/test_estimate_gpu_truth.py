"""functp.estimate against the CUDA allocator: the plain PyTorch tape steps measured on
an H200 (tests/data/gpu_truth_h200.json, its programs in gpu_truth_programs.py), each
estimated here as the cuda program it is, on this CPU-only torch."""
import importlib.util
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
# One step kind per shape (tape), and all three on the small shape. Bounds: 5% where
# the estimate holds; looser, with the reason, where it does not yet:
# - the 8B-shaped SDPA rows: the estimate's step peak is 1.49x (tape) and 1.26x
#   (func.grad) the measured one, while the same program without functp estimates
#   within 2%: under functp's union rule the CPU fakes' SDPA counts more than CUDA's
#   flash kernel holds (not yet found; issue 40);
# - func.grad of the 8B shape (eager): 1.18x; the measurement was taken on main with
#   the size-1 pvarys removed (no pvary node over a 1-rank axis), which this estimate
#   of the same program does not yet reflect everywhere.
# - the 8B-shaped eager rows' step peak: 1.06x (tape), the plain program's within 5%:
#   the union rule's pvary'd copies counted on the fakes that the GPU run does not make.
_LOOSE = {("8b-L2 1x2048 sdpa", "functp tape"): 1.55,
          ("8b-L2 1x2048 eager", "functp tape"): 1.10,
          ("8b-L2 1x2048 sdpa", "functp func.grad"): 1.30,
          ("8b-L2 1x2048 eager", "functp func.grad"): 1.22}
_CHOSEN = [r for r in FUNCTP_ROWS
           if r["step"] == "functp tape" or r["name"].startswith("mid")
           or (r["name"], r["step"]) in _LOOSE]


@pytest.mark.parametrize("row", _CHOSEN, ids=[f"{r['name']}-{r['step']}" for r in _CHOSEN])
def test_gpu_truth_functp_steps(row):
    """functp's own steps (tape, value_and_grad, torch.func.grad over a 1x1 mesh)
    against the allocator: the resident bytes within 5% everywhere (functp leaves
    nothing allocated between steps beyond the parameters: the fix of its cycles);
    the step peak and total peak within 5%, or the documented bound above."""
    program = _programs("gpu_truth_functp_programs").program
    est = functp.estimate(lambda: program(row["config"], "cuda", row["step"])(), 1)
    assert abs(est.resident_bytes / row["resident_bytes"] - 1) < 0.05
    bound = _LOOSE.get((row["name"], row["step"]))
    step = est.step_peak_bytes / row["step_peak_above_resident_bytes"]
    total = est.peak_bytes / row["peak_total_bytes"]
    if bound is None:
        assert abs(step - 1) < 0.05 and abs(total - 1) < 0.05, (step, total)
    else:          # over-estimates, never under
        assert 0.95 < step < bound and 0.95 < total < bound, (step, total)


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
