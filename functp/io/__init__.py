"""Leaving and entering functp: DTensor interop and checkpoints."""
