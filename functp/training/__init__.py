"""Training helpers: grad and value_and_grad, remat, gradient norms and clipping,
optimizer state specs, functionalize."""
