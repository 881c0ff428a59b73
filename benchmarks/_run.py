"""What every benchmark script does around its measurement: start its own processes
when run directly, and end by writing rank 0's results to benchmarks/results/."""
from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
# The two-emulated-hosts script lives beside the checkout, in the shared folder the
# project's machines have (../shared/tools/ from the repository root); FUNCTP_NETNS_CLUSTER
# names another copy.
NETNS_CLUSTER = os.environ.get(
    "FUNCTP_NETNS_CLUSTER",
    os.path.normpath(os.path.join(HERE, "..", "..", "shared", "tools", "netns_cluster.sh")))


def main_or_launch(main, nproc: int, script: str, *args: str) -> None:
    """Under torchrun (RANK set): ``main()``. Run directly: ``script`` again, under
    torchrun on ``nproc`` local processes, with the arguments ``args``."""
    if "RANK" in os.environ:
        main()
        return
    from torch.distributed.run import main as torchrun
    torchrun(["--standalone", "--nproc-per-node", str(nproc), os.path.abspath(script), *args])


def save_and_leave(name: str, res: dict) -> None:
    """Rank 0 writes ``res`` to results/<name>.json; every rank leaves the group."""
    if dist.get_rank() == 0:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"{name}.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
