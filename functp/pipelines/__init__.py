"""Pipeline parallelism: a model's layers split into stages over a ``pp`` axis, and the
schedules (GPipe, 1F1B, interleaved, zero-bubble) that run its microbatches."""
