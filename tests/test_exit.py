"""A script under torchrun exits with status 0 without tearing anything down itself:
functp ended the process group it started (torch 2.13's gloo aborts the interpreter's
own teardown otherwise)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# registered before functp's own exit handler, so it runs after it (atexit is LIFO)
_SCRIPT = textwrap.dedent("""
    import atexit, sys
    import torch, torch.distributed as dist
    import functp
    from functp import P

    def after_functp():
        import threading
        print(f"rank {RANK}: process group live at exit: {dist.is_initialized()}", flush=True)
        # functp's watcher (runtime/_watch) must be gone too: a daemon thread still in
        # a store call when the interpreter finalizes aborts the process
        watching = any(t.name == "functp-watch" for t in threading.enumerate())
        print(f"rank {RANK}: watcher live at exit: {watching}", flush=True)

    RANK = None
    atexit.register(after_functp)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((2,), ("x",))
    RANK = functp.process_index()
    block = functp.shard(torch.arange(4.0), mesh, P("x"))
    total = functp.shard_map(lambda b: functp.psum(b.sum(), "x"), mesh,
                             in_specs=P("x"), out_specs=P())(block)
    if "--destroy" in sys.argv:         # a program that ends the group itself
        dist.destroy_process_group()
    print(f"rank {RANK}: total {total.item()}", flush=True)
""")


def _torchrun(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_functp_ends_the_process_group_it_started(tmp_path):
    out = _torchrun(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in (0, 1):
        assert f"rank {r}: total 6.0" in out.stdout, out.stdout + out.stderr
        assert f"rank {r}: process group live at exit: False" in out.stdout, out.stdout
        assert f"rank {r}: watcher live at exit: False" in out.stdout, out.stdout


def test_a_program_that_ends_the_group_itself_exits_cleanly(tmp_path):
    out = _torchrun(tmp_path, "--destroy")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("process group live at exit: False") == 2, out.stdout
    assert out.stdout.count("watcher live at exit: False") == 2, out.stdout
    assert "could not end the process group" not in out.stderr, out.stderr
