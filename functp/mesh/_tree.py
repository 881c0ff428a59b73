"""Matching a spec tree (a pytree prefix) against the values it describes: one spec per
leaf (``match_specs``), checked against the mesh and the leaf's shape (``leaf_specs``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optree
import torch

from ..runtime._errors import ShardingError, keystr, leaf_text
from ._spec import is_spec, normalize_spec

if TYPE_CHECKING:
    from ._mesh import Mesh

__all__ = ["match_specs", "leaf_specs"]


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
            what = leaf_text("a tensor", s.shape) if hasattr(s, "shape") else repr(s)
            raise ShardingError(
                f"{keystr(specs_name, p)} is {what}, which is not a spec; {hint}")
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=is_spec)
    except ValueError:
        # not optree's text: it prints the whole tree, values of every tensor included
        path, have, want = _first_mismatch(specs, tree, ())
        raise ShardingError(
            f"{specs_name} must be a pytree prefix of the {root} (one spec can cover a "
            f"whole subtree), but {keystr(specs_name, path)} is {have} where "
            f"{keystr(root, path)} is {want}; give one spec per leaf there, or a single "
            f"P(...) for the whole subtree") from None
    paths, leaves, treespec = optree.tree_flatten_with_path(tree)
    leaf_specs = optree.tree_leaves(full, is_leaf=is_spec)
    assert len(leaf_specs) == len(leaves)
    return [keystr(root, p) for p in paths], leaves, leaf_specs, treespec


def leaf_specs(tree, mesh: Mesh, specs, root: str, what: str = "specs"):
    """``[(path, leaf, spec or None)]`` and the treespec of ``tree``: ``specs`` (a prefix
    of it, named ``what`` in messages) broadcast to its leaves and checked against
    ``mesh`` and each tensor's shape; ``None`` for a non-tensor leaf."""
    paths, leaves, spec_leaves, treespec = match_specs(specs, tree, what, root)
    out = []
    for path, x, spec in zip(paths, leaves, spec_leaves):
        if isinstance(x, torch.Tensor):
            spec = normalize_spec(spec, mesh.axis_names, f"{what} for {path}", x.shape)
        else:
            spec = None
        out.append((path, x, spec))
    return out, treespec


def _node(x):
    """``(type, entries, children)`` of one pytree level; ``None`` for a leaf."""
    if optree.tree_is_leaf(x):
        return None
    out = optree.tree_flatten_one_level(x)
    return type(x), tuple(out.entries), list(out.children)


def _describe(x, node) -> str:
    if node is None:
        return (leaf_text("a tensor", x.shape) if hasattr(x, "shape")
                else f"a {type(x).__name__} leaf")
    kind, entries, _ = node
    if isinstance(x, dict):
        keys = [repr(k) for k in entries]
        return f"a {kind.__name__} with keys [{', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}]"
    return f"a {kind.__name__} of {len(entries)}"


def _first_mismatch(specs, tree, path: tuple):
    """The first place where ``specs`` stops being a prefix of ``tree``:
    ``(path, what specs has there, what tree has there)``, described without values."""
    if is_spec(specs):
        return None
    s, t = _node(specs), _node(tree)
    if (s is not None and t is not None and isinstance(specs, dict)
            and isinstance(tree, dict) and set(s[1]) != set(t[1])):
        missing = [repr(k) for k in t[1] if k not in s[1]]
        extra = [repr(k) for k in s[1] if k not in t[1]]
        have = (f"missing key(s) {', '.join(missing[:4])}" if missing else
                f"extra key(s) {', '.join(extra[:4])}")
        return path, f"a dict with {have}", _describe(tree, t)
    if s is None or t is None or s[0] is not t[0] or s[1] != t[1]:
        return path, _describe(specs, s), _describe(tree, t)
    for e, sc, tc in zip(s[1], s[2], t[2]):
        hit = _first_mismatch(sc, tc, path + (e,))
        if hit is not None:
            return hit
    return path, _describe(specs, s), _describe(tree, t)    # not reached: optree disagreed
