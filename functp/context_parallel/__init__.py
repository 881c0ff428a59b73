"""Context parallelism: attention over a sequence split along a ``cp`` axis (all-gather
K/V, Ulysses, ring), with gradients of the whole sequence's attention."""
