"""The examples run as a user runs them and check themselves against the unsharded model.

Most run here as simulated ranks in this process (``python examples/x.py --simulate``
does the same); train_2d, ring attention and the full Llama step (checkpoints) run
as processes, launched by themselves or by torchrun."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys

import pytest
import torch

import functp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_2d_launches_itself_and_matches_unsharded():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_2d.py")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sharded training matches the unsharded model" in out.stdout, out.stdout
    assert out.stdout.count("match") >= 5 and "MISMATCH" not in out.stdout, out.stdout


def _run_example(script: str, nproc: int | None = None, simulate: bool = False) -> str:
    """Runs ``examples/<script>`` as a user would: directly (it launches its own
    processes), with ``nproc`` under torchrun with that many processes, or with
    ``simulate`` as its ranks (``nproc`` or its own count) simulated in this process.
    Returns its stdout after
    checking that it succeeded and reported no mismatch."""
    path = os.path.join(ROOT, "examples", script)
    if simulate:
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location(f"example_{script[:-3]}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        threads, out = torch.get_num_threads(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                results = functp.simulate(module.main, nproc or module.NPROC)
        finally:
            sys.path.remove(os.path.dirname(path))
            torch.set_num_threads(threads)        # main() sets one thread
        assert all(results), out.getvalue()
        assert "MISMATCH" not in out.getvalue(), out.getvalue()
        return out.getvalue()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = ([sys.executable, path] if nproc is None else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), path])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MISMATCH" not in out.stdout, out.stdout
    return out.stdout


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
    assert out.count("   match   collectives {('permute', ('pp',)): 8") == 4, out


def _run_with_args(script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MISMATCH" not in out.stdout, out.stdout
    return out.stdout


def test_train_llama_full_matches_unsharded_in_float64_and_bf16():
    # remat, microbatches with one dp reduction, clipping, AdamW, save on (2, 2) and
    # resume on (1, 4): every step against the unsharded run
    out = _run_with_args("train_llama_full.py")
    assert "training matches the unsharded model" in out and out.count("   match") == 6, out
    assert "resumed on (dp=1, tp=4)" in out, out
    out = _run_with_args("train_llama_full.py", "--bf16")
    assert "bf16 training matches the unsharded model" in out, out


def test_transformers_llama_with_its_own_plan_matches_unsharded():
    pytest.importorskip("transformers")
    out = _run_example("hf_llama.py", nproc=4, simulate=True)
    assert "transformers Llama training matches the unsharded model" in out, out
    assert out.count("   match   collectives {('all_reduce', ('tp',)): 10, "
                     "('all_gather', ('tp',)): 1, ('all_reduce', ('dp',)): 2}") == 6, out
