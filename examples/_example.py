"""What every example does around its own code: start its processes when run
directly, and end by comparing its parameters with the unsharded run's."""
from __future__ import annotations

import os
import sys

import torch


def launch(main, nproc: int) -> None:
    """Under torchrun: run ``main``. Started directly (``python examples/x.py``):
    start ``nproc`` local processes running this script under torchrun."""
    if "RANK" in os.environ:
        main()
        return
    from torch.distributed.run import main as torchrun
    torchrun(["--standalone", "--nproc-per-node", str(nproc), sys.modules["__main__"].__file__])


def finish(final: dict, ref: dict, ok: bool, what: str, steps: int, how: str = "") -> None:
    """Compares the trained (unsharded) parameters with the reference run's, prints
    the verdict on rank 0 and leaves the process group; exits 1 on any mismatch."""
    err = max((final[k] - ref[k].detach()).abs().max().item() for k in ref)
    ok = ok and err < 1e-9
    if torch.distributed.get_rank() == 0:
        print(f"max |param difference| after {steps} {how}steps: {err:.2e}")
        print(f"{what} matches the unsharded model" if ok else "MISMATCH")
    torch.distributed.destroy_process_group()
    if not ok:
        sys.exit(1)
