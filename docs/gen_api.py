"""Writes docs/api.md, the API reference, from functp's docstrings.

    python docs/gen_api.py          # rewrite docs/api.md
    python docs/gen_api.py --check  # exit 1 if docs/api.md is out of date (CI runs this)

Every name in ``functp.__all__`` gets its signature and its docstring, grouped by the
module that defines it, in the order of ``__all__``.
"""
from __future__ import annotations

import inspect
import os
import sys

import functp

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "api.md")

SECTIONS = [
    ("Meshes and specs", ["_mesh", "_spec", "_errors"]),
    ("Sharding whole values", ["_sharding", "_reshard", "_functional"]),
    ("shard_map", ["_shard_map"]),
    ("Collectives", ["_collectives", "_ragged"]),
    ("Communication log and the cross-rank check", ["_comm_log", "_crosscheck"]),
    ("One process: simulated ranks, printing, layouts", ["_simulate", "_world", "_show"]),
    ("Dry runs: what a step costs", ["_estimate", "_host_time", "_rank_meshes", "_hardware"]),
    ("Training: gradients, norms, accumulation, mixed precision, remat, optimizers",
     ["_autodiff", "_grads", "_overlap", "_precision", "_remat", "_optim"]),
    ("Plans and styles", ["_parallelize", "_plans", "_rules", "_verify", "_style", "_tp", "_ep", "_hf",
                          "_fsdp_style"]),
    ("DTensor and checkpoints", ["_interop", "_checkpoint"]),
    ("Pretrained transformers checkpoints", ["_pretrained"]),
]


class _Raw(str):
    """An annotation kept as written (``from __future__ import annotations`` makes
    them strings, which inspect would print quoted)."""

    def __repr__(self) -> str:
        return str(self)


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    raw = lambda a: _Raw(a) if isinstance(a, str) else a
    params = [p.replace(annotation=raw(p.annotation)) for p in sig.parameters.values()]
    ret = inspect.Signature.empty if inspect.isclass(obj) else raw(sig.return_annotation)
    return str(sig.replace(parameters=params, return_annotation=ret))


def render() -> str:
    by_module: dict[str, list[str]] = {}
    for name in functp.__all__:
        mod = getattr(functp, name).__module__.rsplit(".", 1)[-1]
        by_module.setdefault(mod, []).append(name)
    known = {m for _, mods in SECTIONS for m in mods}
    missing = sorted(set(by_module) - known)
    if missing:
        raise SystemExit(f"gen_api.py: add the modules {missing} to SECTIONS")
    out = ["# API reference", "",
           "Generated from the docstrings by `python docs/gen_api.py`; "
           "`tests/test_docs.py` checks that it is current.", ""]
    for title, mods in SECTIONS:
        names = [n for m in mods for n in by_module.get(m, [])]
        if not names:
            continue
        out += [f"## {title}", ""]
        for name in names:
            obj = getattr(functp, name)
            kind = "class " if inspect.isclass(obj) else ""
            out += [f"### `{kind}functp.{name}{_signature(obj)}`", ""]
            doc = inspect.getdoc(obj) or "(no docstring)"
            out += ["```text", doc, "```", ""]
    return "\n".join(out)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        current = open(TARGET).read() if os.path.exists(TARGET) else ""
        if current != text:
            print("docs/api.md is out of date: run python docs/gen_api.py")
            return 1
        return 0
    with open(TARGET, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
