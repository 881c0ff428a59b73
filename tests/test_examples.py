"""The examples run as a user runs them and check themselves against the unsharded model.

Most run here as simulated ranks in this process (``python examples/x.py --simulate``
does the same); train_2d, ring attention, the full Llama step and train_lm
(checkpoints, a resume in a fresh process) run as processes, launched by themselves
or by torchrun."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import functp
from _programs import ROOT, _run_example, example_main


def test_train_2d_launches_itself_and_matches_unsharded():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_2d.py")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sharded training matches the unsharded model" in out.stdout, out.stdout
    assert out.stdout.count("match") >= 5 and "MISMATCH" not in out.stdout, out.stdout


def test_data_parallel_matches_unsharded():
    out = _run_example("data_parallel.py", simulate=True)
    assert "data-parallel training matches the unsharded model" in out, out
    assert out.count("   match   collectives {('all_reduce', ('dp',)): 2}") == 5, out


def test_fsdp_matches_unsharded_and_regathers_in_backward():
    out = _run_example("fsdp.py", simulate=True)
    assert "FSDP training matches the unsharded model" in out, out
    assert out.count("   match\n") == 4, out
    assert "checkpointed:    {('all_gather', ('dp',)): 12" in out, out


def test_megatron_tp_matches_unsharded():
    out = _run_example("megatron_tp.py", simulate=True)
    assert "tensor-parallel training matches the unsharded model" in out, out
    assert out.count("   match   collectives {('all_reduce', ('tp',)): 8}") == 4, out


def test_sequence_parallel_matches_unsharded():
    out = _run_example("sequence_parallel.py", simulate=True)
    assert "sequence-parallel training matches the unsharded model" in out, out
    assert out.count("   match\n") == 4, out


def test_moe_expert_parallel_matches_unsharded():
    out = _run_example("moe_expert_parallel.py", simulate=True)
    assert "expert-parallel training matches the unsharded model" in out, out
    assert out.count("   match   collectives {('all_to_all', ('ep',)): 4") == 4, out


def test_ring_attention_matches_full_attention_under_torchrun():
    # launched by torchrun with 2 processes (the file's own default is 4)
    out = _run_example("ring_attention.py", nproc=2)
    assert "ring attention matches full attention" in out, out
    assert out.count("   match\n") == 7, out           # output, loss, 4 weight grads, grad x


def test_collective_matmul_matches_all_gather_matmul():
    out = _run_example("collective_matmul.py", nproc=2, simulate=True)
    assert "collective matmuls match all_gather/psum_scatter + matmul" in out, out
    assert out.count("   match\n") == 2, out


def test_pipeline_matches_unsharded():
    out = _run_example("pipeline.py", simulate=True)
    assert "pipelined training matches the unsharded model" in out, out
    # 1F1B's transfers merge into 6 ticks; the agreement, a boundary's shape (the first
    # step only: later calls of the same shapes reuse it, c169854) and the loss
    assert out.count("   match   collectives {('all_gather', ('pp',)): 3, "
                     "('permute', ('pp',)): 6}") == 1, out
    assert out.count("   match   collectives {('all_gather', ('pp',)): 2, "
                     "('permute', ('pp',)): 6}") == 3, out


def _run_with_args(script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MISMATCH" not in out.stdout, out.stdout
    return out.stdout


def test_train_llama_full_matches_unsharded_in_float64_and_bf16(run):
    # remat, microbatches with one dp reduction, clipping, AdamW, save on (2, 2) and
    # resume on (1, 4): every step against the unsharded run
    out = _run_with_args("train_llama_full.py")
    assert "training matches the unsharded model" in out and out.count("   match") == 6, out
    assert "resumed on (dp=1, tp=4)" in out, out
    # (bf16: the same program on the 4 processes of a gloo pool, not launched again)
    ok, out = zip(*run(4, example_main, "train_llama_full.py", None, {"BF16": True},
                       gloo=True, timeout=300))
    assert all(ok) and "bf16 training matches the unsharded model" in out[0], out[0]


def test_transformers_llama_with_its_own_plan_matches_unsharded():
    pytest.importorskip("transformers")
    out = _run_example("hf_llama.py", nproc=4, simulate=True)
    assert "transformers Llama training matches the unsharded model" in out, out
    assert out.count("   match   collectives {('all_reduce', ('tp',)): 10, "
                     "('all_gather', ('tp',)): 1, ('all_reduce', ('dp',)): 2}") == 6, out


# -- train_lm.py: a real training run, short ------------------------------------------

_LM_SMALL = ["--hidden", "64", "--layers", "1", "--seq", "64", "--batch", "8",
             "--steps", "16", "--eval-every", "8", "--ckpt-every", "8"]


def _metrics(out_dir) -> dict[int, dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}


def _eval_fall(stdout: str) -> tuple[float, float]:
    m = re.search(r"eval loss (\d+\.\d+) -> (\d+\.\d+)", stdout)
    assert m, stdout
    return float(m.group(1)), float(m.group(2))


def test_train_lm_loss_falls_and_resumes_on_another_mesh_in_a_fresh_process(run, tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    # as the README runs it: the script launches its 4 processes on (dp=2, tp=2)
    out = _run_with_args("train_lm.py", *_LM_SMALL, "--out", str(first))
    start, end = _eval_fall(out)
    assert start > 5.0 and end < start - 1.0, out           # from ~ln(256) to clearly lower
    assert re.search(r"[\d,]+ tokens/s", out), out
    assert sorted(os.listdir(first)) == ["loss.png", "metrics.jsonl", "step_000008",
                                        "step_000016"], os.listdir(first)
    with open(first / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # other processes (a gloo pool's 4) on (dp=1, tp=4), from the step-8 checkpoint: a
    # fresh AdamW given its state, then the same batches as the uninterrupted run
    ok, resumed = zip(*run(4, example_main, "train_lm.py", [
        *_LM_SMALL, "--mesh", "1x4", "--resume", str(first / "step_000008"),
        "--out", str(again)], gloo=True, timeout=300))
    assert all(ok), resumed[0]
    resumed = resumed[0]
    assert "at step 8 on (dp=1, tp=4)" in resumed, resumed
    a, b = _metrics(first), _metrics(again)
    assert sorted(b) == list(range(17)), sorted(b)    # the history up to 8, then 9..16
    for step in range(9, 17):
        # float32 sums in another order on another mesh: equal to rounding; a resume
        # without the AdamW moments is off by about 1e-2 from the second step on
        assert math.isclose(a[step]["loss"], b[step]["loss"], rel_tol=1e-4), (a[step], b[step])
    assert math.isclose(a[16]["eval_loss"], b[16]["eval_loss"], rel_tol=1e-4), (a[16], b[16])


def test_train_lm_runs_as_simulated_ranks(tmp_path):
    # main(argv) on 4 simulated ranks, as `python examples/train_lm.py --simulate` does
    path = os.path.join(ROOT, "examples", "train_lm.py")
    spec = importlib.util.spec_from_file_location("example_train_lm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--hidden", "64", "--layers", "1", "--seq", "32", "--batch", "8", "--steps", "6",
            "--eval-every", "3", "--ckpt-every", "3", "--out", str(tmp_path)]
    threads, out = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            results = functp.simulate(module.main, 4, args)
    finally:
        torch.set_num_threads(threads)            # main() sets one thread
    assert results == [True] * 4, out.getvalue()   # every rank saw the eval loss fall
    start, end = _eval_fall(out.getvalue())
    assert end < start, out.getvalue()
    assert "checkpoints are skipped under --simulate" in out.getvalue(), out.getvalue()
    assert sorted(_metrics(tmp_path)) == list(range(7))


# -- train_lm.py --cp and --compile: the losses of the run without the flag ------------

# one layer, 32-token sequences, 4 steps on (dp=2, tp=1), in float64: the same batches
# and initial model with and without each flag, so the per-step losses must agree to
# float64 rounding (in float32 they agree to ~1e-6 here: docs/training.md)
_LM_TINY = ["--mesh", "2x1", "--hidden", "64", "--layers", "1", "--seq", "32", "--batch", "8",
            "--steps", "4", "--eval-every", "2", "--ckpt-every", "100", "--float64"]
_F64 = 1e-12


def _simulated_train_lm(out_dir, *flags: str) -> dict[int, dict]:
    """``python examples/train_lm.py --simulate <_LM_TINY> <flags>``, in this process,
    without the check mode (so that parallelize's calls are replayed after the first,
    as in processes: the check mode records every call): its metrics by step."""
    path = os.path.join(ROOT, "examples", "train_lm.py")
    spec = importlib.util.spec_from_file_location("example_train_lm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [*_LM_TINY, *flags, "--out", str(out_dir)]
    threads, out = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            results = functp.simulate(module.main, module.parse_args(argv).nproc, argv,
                                      check=False)
    finally:
        torch.set_num_threads(threads)            # main() sets one thread
    assert results == [True] * len(results), out.getvalue()
    return _metrics(out_dir)


@pytest.fixture(scope="module")
def lm_without_flags(tmp_path_factory):
    return _simulated_train_lm(tmp_path_factory.mktemp("lm_plain"))


def _same_losses(got: dict, want: dict, rel: float) -> None:
    assert sorted(got) == sorted(want) == list(range(5)), (sorted(got), sorted(want))
    for step in range(1, 5):
        assert math.isclose(got[step]["loss"], want[step]["loss"], rel_tol=rel), (
            step, got[step], want[step])
    for step in (0, 2, 4):
        assert math.isclose(got[step]["eval_loss"], want[step]["eval_loss"], rel_tol=rel), (
            step, got[step], want[step])


@pytest.mark.parametrize("strategy", ["allgather", "ulysses", "ring"])
def test_train_lm_with_cp_trains_to_the_losses_without(lm_without_flags, tmp_path, strategy):
    # dp2 x cp2 on 4 simulated ranks: each rank holds two 8-token chunks of each of its
    # sequences, the attention is functp.attention over the sequence axis (a rotary at
    # the block's own positions 0..15 instead of the tokens' is off by 6e-4 to 2e-3)
    got = _simulated_train_lm(tmp_path, "--cp", "2", "--cp-strategy", strategy)
    _same_losses(got, lm_without_flags, rel=_F64)


@pytest.fixture(scope="module")
def lm_two_layers(tmp_path_factory):
    return _simulated_train_lm(tmp_path_factory.mktemp("lm_two"), "--layers", "2")


@pytest.mark.parametrize("mesh,schedule", [("2x1", "1f1b"), ("1x2", "zero_bubble")])
def test_train_lm_with_pp_trains_to_the_losses_without(lm_two_layers, tmp_path, mesh, schedule):
    # the two layers in two stages beside dp2 or tp2, 4 microbatches per dp row, the
    # whole batch given to every rank; the clip (active: a stage's own norm is 1.2-2.5
    # here) is by the whole model's norm, every stage's gradients in it (a stage's own
    # norm gave other losses from step 2 on)
    got = _simulated_train_lm(tmp_path, "--layers", "2", "--mesh", mesh, "--pp", "2",
                              "--schedule", schedule)
    _same_losses(got, lm_two_layers, rel=_F64)


def test_train_lm_pipeline_checkpoint_resumes_without_the_pipeline(run, tmp_path):
    # pp2 x tp2's stages save one checkpoint (their union: AdamW's moments by parameter
    # name, each stage numbering its own from 0); dp2 without a pipeline resumes it to
    # the uninterrupted run's losses in float64 (without the moments: off by ~1e-2)
    first, again = tmp_path / "first", tmp_path / "again"
    args = [*_LM_TINY, "--layers", "2", "--ckpt-every", "2"]
    ok, out = zip(*run(4, example_main, "train_lm.py", [
        *args, "--mesh", "1x2", "--pp", "2", "--out", str(first)], gloo=True, timeout=300))
    assert all(ok) and "saved" in out[0], out[0]
    assert sorted(os.listdir(first)) == ["loss.png", "metrics.jsonl", "step_000002",
                                        "step_000004"], os.listdir(first)
    ok, out = zip(*run(2, example_main, "train_lm.py", [
        *args, "--mesh", "2x1", "--resume", str(first / "step_000002"), "--out", str(again)],
        gloo=True, timeout=300))
    assert all(ok) and "at step 2 on (dp=2, tp=1): parameters, and AdamW state for 19" in out[0]
    a, b = _metrics(first), _metrics(again)
    assert sorted(b) == list(range(5)), sorted(b)     # the history up to 2, then 3..4
    for step in (3, 4):
        assert math.isclose(a[step]["loss"], b[step]["loss"], rel_tol=_F64), (a[step], b[step])
    assert math.isclose(a[4]["eval_loss"], b[4]["eval_loss"], rel_tol=_F64)


def test_train_lm_compiled_whole_step_trains_to_the_eager_losses(run, lm_without_flags, tmp_path):
    # two gloo processes: gradients, clip_by_global_norm and functp.adamw(donate=
    # True) as one torch.compile(fullgraph=True) graph (aot_eager here: Inductor's
    # compile takes minutes on 2 cores; in float32 it was seen within 5e-7 of eager
    # over 6 steps), against the eager step with torch.optim.AdamW
    ok, out = zip(*run(2, example_main, "train_lm.py", [
        *_LM_TINY, "--compile", "aot_eager", "--out", str(tmp_path)], gloo=True, timeout=300))
    assert all(ok) and "compiled the whole step in" in out[0], out[0]
    _same_losses(_metrics(tmp_path), lm_without_flags, rel=_F64)
