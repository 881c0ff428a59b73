"""What every example does around its own code: start its processes when run
directly, and end by comparing its parameters with the unsharded run's."""
from __future__ import annotations

import os
import sys

import torch

import functp


def launch(main, nproc: int) -> None:
    """Under torchrun: run ``main``. Started directly (``python examples/x.py``):
    start ``nproc`` local processes running this script under torchrun; with
    ``--simulate``, run ``main`` as ``nproc`` simulated ranks in this process
    (``functp.simulate``: no processes, and a debugger or a print sees every rank)."""
    if "RANK" in os.environ:
        main()
        return
    if "--simulate" in sys.argv[1:]:
        import functp
        sys.exit(0 if all(functp.simulate(main, nproc)) else 1)
    from torch.distributed.run import main as torchrun
    torchrun(["--standalone", "--nproc-per-node", str(nproc), sys.modules["__main__"].__file__])


def finish(final: dict, ref: dict, ok: bool, what: str, steps: int, how: str = "") -> bool:
    """Compares the trained (unsharded) parameters with the reference run's, prints
    the verdict on rank 0 and leaves the process group; exits 1 on any mismatch
    (returns the verdict under ``functp.simulate``)."""
    err = max((final[k] - ref[k].detach()).abs().max().item() for k in ref)
    ok = ok and err < 1e-9
    if functp.process_index() == 0:
        print(f"max |param difference| after {steps} {how}steps: {err:.2e}")
        print(f"{what} matches the unsharded model" if ok else "MISMATCH")
    return shutdown(ok)


def shutdown(ok: bool = True) -> bool:
    """Leaves the process group once every rank is done with it and ends the process
    (exit status 1 unless ``ok``). Under ``functp.simulate`` (no process group) it
    returns ``ok`` instead: the caller's process goes on.

    Without the barrier, a rank that tears its gloo groups down while a peer still
    uses them can abort that peer; and even after a clean destroy, gloo's threads can
    abort the interpreter's own teardown ("terminate called without an active
    exception": 1 exit in 6-10 on 2 ranks here, 0 in 12 with this sequence)."""
    if not torch.distributed.is_initialized():
        return ok
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)
