"""Matching a spec tree (a pytree prefix) against the values it describes."""
from __future__ import annotations

from typing import Any

import optree

from ._errors import ShardingError
from ._spec import is_spec


def keystr(root: str, path: tuple) -> str:
    """``('args', (0, 'w'))`` -> ``"args[0]['w']"``, the way JAX prints key paths."""
    return root + "".join(f"[{k!r}]" for k in path)


def match_specs(specs: Any, tree: Any, specs_name: str, root: str):
    """Broadcasts ``specs`` (a prefix of ``tree``) to one spec per leaf of ``tree``.

    Returns ``(paths, leaves, leaf_specs, treespec)``; ``paths`` are printable
    (``"args[0]['fc1.weight']"``) and ``treespec`` rebuilds ``tree``.
    """
    spec_paths, spec_leaves, _ = optree.tree_flatten_with_path(
        specs, is_leaf=is_spec, none_is_leaf=True)
    for p, s in zip(spec_paths, spec_leaves):
        if not is_spec(s):
            hint = "use P() for a replicated value" if s is None else "use P(...)"
            raise ShardingError(
                f"{keystr(specs_name, p)} is {s!r}, which is not a spec; {hint}")
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=is_spec)
    except ValueError as e:
        raise ShardingError(
            f"{specs_name} must be a pytree prefix of the {root} (one spec can cover a "
            f"whole subtree), but its structure {optree.tree_structure(specs, is_leaf=is_spec)} "
            f"does not match {optree.tree_structure(tree)}: {e}") from None
    paths, leaves, treespec = optree.tree_flatten_with_path(tree)
    leaf_specs = optree.tree_leaves(full, is_leaf=is_spec)
    assert len(leaf_specs) == len(leaves)
    return [keystr(root, p) for p in paths], leaves, leaf_specs, treespec
