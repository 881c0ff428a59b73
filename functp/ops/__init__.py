"""The collectives: raw c10d calls, registered differentiable ops, vma tracking."""
