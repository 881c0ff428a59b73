"""Meshes, specs, and what a spec means on a mesh (every block's arithmetic)."""
