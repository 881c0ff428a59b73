"""Parallel styles and plans: a torch.nn model to specs and bodies."""
