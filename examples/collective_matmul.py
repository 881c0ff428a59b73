"""Collective matmuls: an all-gather followed by a matmul (and a matmul followed by a
reduce-scatter) decomposed into a ring of ppermutes and partial matmuls, so that
each transfer can run while the previous block is being multiplied.

    torchrun --standalone --nproc-per-node 4 examples/collective_matmul.py
    python examples/collective_matmul.py  # launches the 4 local processes itself
    python examples/collective_matmul.py --simulate  # or as 4 simulated ranks in one process

All-gather matmul: the rows of ``lhs`` (activations) and the contraction dim of
``rhs`` (a weight) are split over 'tp', as in FSDP (examples/fsdp.py).
``lhs_block @ all_gather(rhs_block)`` waits for the whole gather before any
multiply. The ring version multiplies by the block it holds while that block is
sent on to the right neighbour, so after ``tp`` steps every block has been used and
each transfer had a matmul to hide behind (Wang et al., 2023, "Overlap communication
with dependent computation via decomposition"; the JAX shard_map notebook).

Reduce-scatter matmul (a row-parallel layer with its output split by rows, as when
examples/sequence_parallel.py leaves its tensor-parallel region): each rank's
``lhs_block @ rhs_block`` is a partial sum of the whole output, which
psum_scatter sums and splits by rows. The ring version passes an accumulator
around: each rank adds its partial sum for the row block the accumulator is
destined for, and the accumulator arrives home after ``tp - 1`` hops.

Both are linear in the blocks that travel, and the transpose of ppermute is the
inverse permutation: torch.func.vjp of the ring versions sends the gradients
around the ring the other way, with no backward written by hand. The program checks
values and gradients of both rings against the plain all_gather / psum_scatter
versions and the unsharded matmul, and prints the collectives each one issued.

Overlap: the ring code issues each ppermute before the matmul that does not need
its result. functp's eager collectives wait for completion before they return, so on
this CPU run the ring shows the program structure a scheduler needs (XLA's, or a
compiler's async collectives), not a speed-up.
"""
from __future__ import annotations


import torch

import functp
from _example import launch, shutdown
from functp import P

NPROC = 4                                   # processes when launched directly
M, K, N = 8, 16, 12


def ring_right(n):
    return [(r, (r + 1) % n) for r in range(n)]


# --- all-gather matmul: lhs (M/tp, K), rhs (K/tp, N) -> out (M/tp, N) -----------------

def allgather_matmul(lhs, rhs_block):
    """The plain version: gather all of rhs, then one matmul."""
    return lhs @ functp.all_gather(rhs_block, "tp", tiled=True)


def allgather_matmul_ring(lhs, rhs_block):
    n, me = functp.axis_size("tp"), functp.axis_index("tp")
    kb = rhs_block.shape[0]
    out = None
    for step in range(n):
        # issue the transfer of the block we hold before using it: the matmul below
        # does not depend on it, so the two can overlap
        nxt = functp.ppermute(rhs_block, "tp", ring_right(n)) if step < n - 1 else None
        j = (me - step) % n                     # we hold the j-th block of rhs's rows
        part = lhs.narrow(1, j * kb, kb) @ rhs_block     # ... which meets lhs's j-th columns
        out = part if out is None else out + part
        rhs_block = nxt
    return out


# --- reduce-scatter matmul: lhs (M, K/tp), rhs (K/tp, N) -> out (M/tp, N) --------------

def matmul_reducescatter(lhs_block, rhs_block):
    """The plain version: the whole partial product, then one reduce-scatter."""
    return functp.psum_scatter(lhs_block @ rhs_block, "tp", scatter_dimension=0, tiled=True)


def matmul_reducescatter_ring(lhs_block, rhs_block):
    n, me = functp.axis_size("tp"), functp.axis_index("tp")
    mb = lhs_block.shape[0] // n
    rows = lambda d: lhs_block.narrow(0, d * mb, mb)
    # at step s this rank adds to the accumulator bound for row block (me - s - 1) % n;
    # at the last step that is block `me`, its own
    acc = rows((me - 1) % n) @ rhs_block
    for step in range(1, n):
        incoming = functp.ppermute(acc, "tp", ring_right(n))   # in flight while ...
        part = rows((me - step - 1) % n) @ rhs_block          # ... this is computed
        acc = incoming + part
    return acc


# the layouts (global shapes: lhs (M, K), rhs (K, N), out (M, N))
AG_SPECS = (P("tp", None), P("tp", None))      # lhs by rows, rhs by the contraction dim
RS_SPECS = (P(None, "tp"), P("tp", None))      # both by the contraction dim
OUT_SPEC = P("tp", None)                       # the product by rows


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((functp.process_count(),), ("tp",))
    n = mesh.shape["tp"]
    rank0 = functp.process_index() == 0

    torch.manual_seed(0)                    # the same data on every rank
    lhs, rhs, ct = torch.randn(M, K), torch.randn(K, N), torch.randn(M, N)
    ref_out = lhs @ rhs
    # gradients of <lhs @ rhs, ct>: ct @ rhs^T and lhs^T @ ct
    ref_grads = (ct @ rhs.T, lhs.T @ ct)
    ok = True
    for name, specs, plain, ring in (
            ("all-gather matmul", AG_SPECS, allgather_matmul, allgather_matmul_ring),
            ("matmul reduce-scatter", RS_SPECS, matmul_reducescatter, matmul_reducescatter_ring)):
        blocks = functp.shard((lhs, rhs), mesh, specs)
        ct_block = functp.shard(ct, mesh, OUT_SPEC)
        results = {}
        for label, body in (("plain", plain), ("ring", ring)):
            f = functp.shard_map(body, mesh, in_specs=specs, out_specs=OUT_SPEC)
            with functp.comm_log() as fwd:
                out, vjp_fn = torch.func.vjp(f, *blocks)
            with functp.comm_log() as bwd:
                grads = vjp_fn(ct_block)         # the operands' gradients for cotangent ct
            out = functp.unshard(out, mesh, OUT_SPEC)
            grads = functp.unshard(grads, mesh, specs)
            err = max((out - ref_out).abs().max().item(),
                      *((g - r).abs().max().item() for g, r in zip(grads, ref_grads)))
            results[label] = (out, err, fwd.summary(), bwd.summary())
        ring_out, ring_err, ring_fwd, ring_bwd = results["ring"]
        plain_out, plain_err, plain_fwd, plain_bwd = results["plain"]
        # the ring: n-1 ppermutes forward, n-1 backward (the inverse ring)
        hops = {("permute", ("tp",)): n - 1} if n > 1 else {}
        match = (ring_err < 1e-12 and plain_err < 1e-12
                 and (ring_out - plain_out).abs().max().item() < 1e-12
                 and ring_fwd == hops and ring_bwd == hops)
        ok &= match
        if rank0:
            print(f"{name}:")
            print(f"    out[0, :3]  ring  {[round(v, 12) for v in ring_out[0, :3].tolist()]}")
            print(f"    out[0, :3]  plain {[round(v, 12) for v in plain_out[0, :3].tolist()]}")
            print(f"    max |diff| from the unsharded matmul and its gradients: ring "
                  f"{ring_err:.1e}, plain {plain_err:.1e}   {'match' if match else 'MISMATCH'}")
            print(f"    collectives forward:  ring {ring_fwd}   plain {plain_fwd}")
            print(f"    collectives backward: ring {ring_bwd}   plain {plain_bwd}")
    if rank0:
        print("collective matmuls match all_gather/psum_scatter + matmul" if ok else "MISMATCH")
    return shutdown(ok)


if __name__ == "__main__":
    launch(main, NPROC)
