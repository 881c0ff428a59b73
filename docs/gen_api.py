"""Writes docs/api.md, the API reference, from functp's docstrings.

    python docs/gen_api.py          # rewrite docs/api.md
    python docs/gen_api.py --check  # exit 1 if docs/api.md is out of date (CI runs this)

Every name in ``functp.__all__`` gets its signature and its docstring, one section per
folder of ``functp/`` (the layers of docs/architecture.md, from the ground up), read
from where the name is defined: a module that moves takes its names to its new
folder's section. Within a section, names follow ``MODULES``' order, then
``__all__``'s.
"""
from __future__ import annotations

import inspect
import os
import sys

import functp

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "api.md")

# the folders of functp/, ground first, and what each holds (docs/architecture.md)
FOLDERS = [
    ("runtime", "errors, the process world, the communication log, the cross-rank check, "
                "mixed precision"),
    ("mesh", "meshes and specs"),
    ("ops", "collectives"),
    ("mapping", "shard_map, and moving whole values between layouts"),
    ("io", "checkpoints"),
    ("context_parallel", "long sequences: attention over a sequence split along a cp axis"),
    ("pipelines", "pipeline parallelism: stages over a pp axis and their schedules"),
    ("parallel", "plans and styles: a torch.nn model to specs and bodies"),
    ("training", "a module as a function, gradient norms, optimizer state"),
    ("tools", "around a program: simulated ranks, dry runs, hardware"),
]
# the reading order of the modules, wherever their folder
MODULES = ["_errors", "_world", "_comm_log", "_crosscheck", "_precision",
           "_mesh", "_spec",
           "_collectives", "_ragged", "_overlap",
           "_sharding", "_reshard", "_shard_map", "_interop", "_autodiff", "_remat", "_show",
           "_checkpoint",
           "_attention", "_layout", "_pipeline", "_schedule",
           "_parallelize", "_plans", "_rules", "_verify", "_style", "_tp", "_ep", "_hf",
           "_fsdp_style", "_cp", "_pp", "_pretrained", "_resize",
           "_functional", "_grads", "_optim", "_optimizers",
           "_simulate", "_estimate", "_host_time", "_rank_meshes", "_hardware"]


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


def _where(name: str) -> tuple[str, str]:
    """(folder, module) of the module that defines ``functp.<name>``."""
    parts = getattr(functp, name).__module__.split(".")
    return parts[1], parts[-1]


def render() -> str:
    where = {name: _where(name) for name in functp.__all__}
    folders = [f for f, _ in FOLDERS]
    loose = sorted({m for f, m in where.values() if f not in folders or m not in MODULES})
    if loose:
        raise SystemExit(f"gen_api.py: add the modules {loose} to MODULES (and their "
                         f"folder to FOLDERS)")
    out = ["# API reference", "",
           "Generated from the docstrings by `python docs/gen_api.py`; "
           "`tests/test_docs.py` checks that it is current. One section per folder of "
           "`functp/`, from the ground up (docs/architecture.md).", ""]
    order = {name: k for k, name in enumerate(functp.__all__)}
    for folder, what in FOLDERS:
        names = sorted((n for n, (f, _) in where.items() if f == folder),
                       key=lambda n: (MODULES.index(where[n][1]), order[n]))
        if not names:
            continue
        out += [f"## `{folder}/`: {what}", ""]
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
