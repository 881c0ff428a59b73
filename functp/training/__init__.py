"""Training helpers: gradient norms and clipping, optimizer state specs."""
