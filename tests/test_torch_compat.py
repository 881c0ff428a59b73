"""The torch internals functp uses: each one present in this torch, each imported only
by ``functp/runtime/_torch_compat.py``, and a missing one reported by name, use and version."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

from functp.runtime import _torch_compat

PKG = pathlib.Path(_torch_compat.__file__).parent
# a private name reached through torch: torch._C, torch.ops._c10d_functional,
# dist.distributed_c10d._resolve_process_group, from torch.utils._pytree import ...
PRIVATE = re.compile(r"\b(?:torch|dist|dcp)(?:\.[A-Za-z]\w*)*\._[A-Za-z]|\b_functorch\b"
                     r"|\)\._[A-Za-z]")     # a private method of a torch object: g.pg()._x()


@pytest.mark.parametrize("path,why", _torch_compat.SYMBOLS,
                         ids=[p for p, _ in _torch_compat.SYMBOLS])
def test_symbol_exists(path, why):
    try:
        obj = _torch_compat.resolve(path, why)
    except ImportError as e:
        pytest.fail(str(e))
    assert obj is not None, path


def test_a_missing_symbol_is_named_with_its_use_and_torch_version():
    with pytest.raises(_torch_compat.TorchIncompatible) as e:
        _torch_compat.resolve("torch._C._functorch.no_such_function", "a test")
    assert str(e.value) == (f"functp needs torch._C._functorch.no_such_function (used for "
                            f"a test); torch {torch.__version__} lacks it")
    with pytest.raises(ImportError, match="torch.no_such_module.x"):
        _torch_compat.resolve("torch.no_such_module.x", "a test")


def test_the_memory_tracker_checks_the_methods_estimate_overrides(monkeypatch):
    # imported at the first estimate, not with functp: a torch without one of the
    # methods functp.estimate's MemTracker subclass overrides is refused then, by name
    from torch.distributed._tools.mem_tracker import MemTracker
    assert _torch_compat.mem_tracker()[0] is MemTracker
    monkeypatch.delattr(MemTracker, "_pre_bw_hook")
    with pytest.raises(_torch_compat.TorchIncompatible, match=r"MemTracker\._pre_bw_hook"):
        _torch_compat.mem_tracker()


def test_every_symbol_is_listed_once():
    paths = [p for p, _ in _torch_compat.SYMBOLS]
    assert len(paths) == len(set(paths))
    assert all(why for _, why in _torch_compat.SYMBOLS)


def test_only_the_quarantine_reaches_torch_internals():
    for private in ("torch._C._functorch.get_unwrapped(x)", "from torch.utils._pytree import a",
                    "dist.distributed_c10d._resolve_process_group(n)", "_functorch.peek()",
                    "torch.ops._c10d_functional.wait_tensor",
                    "dist.ProcessGroupGloo._Options()", "g.pg()._get_sequence_number_for_group()"):
        assert PRIVATE.search(private), private
    for public in ("torch.__file__", "torch.nn.functional.relu", "unwrap_functorch(x)",
                   "from torch.distributed.tensor import DTensor"):
        assert not PRIVATE.search(public), public
    found = []
    for f in sorted(PKG.rglob("*.py")):
        if f.name == "_torch_compat.py":
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE.search(code):
                found.append(f"{f.relative_to(PKG)}:{n}: {line.strip()}")
    assert not found, ("import these torch internals in functp/runtime/_torch_compat.py (listed in "
                       "SYMBOLS) instead:\n" + "\n".join(found))


def test_unwrap_functorch_sees_through_grad_and_vmap():
    seen = []

    def f(x):
        seen.append(_torch_compat.unwrap_functorch(x))
        return x.sum()

    x = torch.arange(6.0).reshape(2, 3)
    torch.func.grad(f)(x)
    torch.vmap(f)(x)
    for t in seen:
        assert type(t) is torch.Tensor and not _torch_compat.is_functorch_wrapped(t), type(t)
    assert seen[0].shape == (2, 3) and seen[1].shape == (2, 3)   # vmap's batch dim kept
    assert torch.equal(seen[0], x) and torch.equal(seen[1], x)


def _supported_range() -> tuple[str, str]:
    text = (PKG.parent.parent / "pyproject.toml").read_text()
    m = re.search(r'"torch>=([\d.]+),<([\d.]+)"', text)
    assert m, "pyproject.toml's torch requirement is not 'torch>=A,<B'"
    return m.group(1), m.group(2)


def test_this_torch_is_in_the_supported_range():
    low, high = _supported_range()
    assert (low, high) == ("2.11", "2.16"), "update the docstring of _torch_compat.py and docs/gpus.md"
    v = torch.torch_version.TorchVersion(torch.__version__.split("+")[0])
    assert low <= v < high, f"torch {torch.__version__} is outside functp's range >={low},<{high}"


def test_is_compiling_holds_for_a_whole_compile_session():
    # 2.11 and 2.12's torch.compiler.is_compiling() is false in a nonstrict_trace call,
    # which Dynamo runs on fake tensors while it compiles; ours is true there, as 2.13's
    seen = []
    _, nonstrict_trace = _torch_compat.dynamo()

    @nonstrict_trace
    def opaque(x):
        seen.append((_torch_compat.is_compiling(), isinstance(x, _torch_compat.FakeTensor)))
        return x * 2

    def f(x):
        return opaque(x) + 1

    x = torch.ones(3)
    assert not _torch_compat.is_compiling()
    f(x)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), f(x))
    assert (False, False) in seen and (True, True) in seen, seen
    assert all(compiling == fake for compiling, fake in seen), seen
    assert not _torch_compat.is_compiling()


def test_dcp_save_returns_the_stored_byte_ranges(tmp_path):
    # functp.save's checksums read them; 2.11's dcp.save returned them as None
    import torch.distributed.checkpoint as dcp
    state = {"a": torch.arange(6.0), "b": torch.ones(2, 3)}
    with warnings.catch_warnings():         # DCP: no process group, so one process
        warnings.simplefilter("ignore")
        meta = dcp.save(state, storage_writer=_torch_compat.MetadataWriter(str(tmp_path)))
    assert meta.storage_data is not None
    assert sorted(i.fqn for i in meta.storage_data) == ["a", "b"]
    assert all(s.length > 0 for s in meta.storage_data.values())


_COMPILE_IN_RANKS = """
import torch, functp
def f(x):
    return torch.sin(x) + x
def rank():
    for _ in range(3):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(f, backend="eager")(torch.ones(2)), f(torch.ones(2)))
functp.simulate(rank, 2)
print("compiled in both ranks")
"""


def test_torch_compile_in_two_simulated_ranks_at_once():
    # torch 2.11's CUDA build without a GPU crashed here (SIGSEGV in FakeTensorMode's
    # entry) unless functp.simulate installs the no-op device guard first; a process of
    # its own, so that a crash fails this test and not the whole run
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _COMPILE_IN_RANKS], capture_output=True,
                         text=True, timeout=300, cwd=PKG.parent.parent)
    assert out.returncode == 0 and "compiled in both ranks" in out.stdout, (
        f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}")


def test_import_functp_leaves_the_compiler_and_the_memory_tracker_for_later():
    # torch._dynamo and torch.distributed._tools (0.55 s of a 3.1 s import) wait for
    # their first use (a compile, an estimate): every process of a launch imports functp
    code = ("import sys, functp; print(sorted(m for m in ('torch._dynamo', "
            "'torch.distributed._tools', 'torch._inductor') if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]", got.stdout
