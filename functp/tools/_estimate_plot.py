"""The PNG of an :class:`functp.Estimate`: each distinct rank's memory at its peak,
by category, beside its predicted step time, split into computation and
communication. matplotlib is an optional extra, imported only here and only when a
plot is asked for."""
from __future__ import annotations

import os
from typing import Any

from ..runtime._errors import ShardingError

__all__ = ["plot"]

# a fixed colour per category, so that two plots read alike
_COLOURS = {"Parameter": "#4c72b0", "Gradient": "#dd8452", "Optstate": "#55a868",
            "Activation": "#c44e52", "Temp": "#8172b3", "Buffer": "#937860",
            "Input": "#da8bc3", "Other": "#8c8c8c"}


def _figure_class():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ShardingError(
            "Estimate.plot needs matplotlib, an optional extra of functp: "
            "pip install matplotlib (or pip install 'functp[examples]')") from e
    return Figure, FigureCanvasAgg


def plot(est, path: str | os.PathLike | None = None) -> Any:
    """Draws ``est``: left, the memory at the peak of each distinct rank, stacked by
    MemTracker's categories (with the profile's memory as a line when it has one);
    right, the predicted compute and communication seconds and the step's two
    bounds. Writes a PNG to ``path`` if given.

    **Arguments:** ``est`` – an :class:`functp.Estimate`; ``path`` – where to
    write the PNG (None: only return the figure).

    **Returns:** the matplotlib ``Figure`` (no pyplot state is touched)."""
    Figure, Canvas = _figure_class()
    fig = Figure(figsize=(10, 1.6 + 0.5 * len(est.ranks)), layout="constrained")
    Canvas(fig)
    mem, time = fig.subplots(1, 2)
    labels = [f"rank {r} (x{len(est.alike.get(r, [r]))})" for r in est.ranks]
    kinds = sorted({k for r in est.ranks for k in est[r].memory},
                   key=lambda k: list(_COLOURS).index(k) if k in _COLOURS else len(_COLOURS))
    hw = est.hardware
    peak = max(est[r].peak_bytes for r in est.ranks)
    budget = hw.memory if hw is not None else 0
    # the budget's line only where it is on the same scale as the bars
    shown = budget if budget and budget <= 2 * peak else 0
    size, byte_unit = _byte_unit(max(peak, shown))
    left = [0.0] * len(est.ranks)
    for k in kinds:
        part = [est[r].memory.get(k, 0) / size for r in est.ranks]
        mem.barh(labels, part, left=left, label=k, color=_COLOURS.get(k))
        left = [a + b for a, b in zip(left, part)]
    if shown:
        mem.axvline(budget / size, color="black", linestyle="--",
                    label=f"memory {budget / size:.3g} {byte_unit}")
    mem.set_xlabel(f"{byte_unit} at the peak")
    mem.set_title(f"memory per rank ({est.nprocs} ranks)" + (
        f", {budget / 2 ** 30:.3g} GiB each" if budget and not shown else ""))
    mem.legend(fontsize="small", loc="lower right")
    if hw is None:
        time.text(0.5, 0.5, "no hardware profile:\nno predicted time", ha="center",
                  va="center")
        time.set_axis_off()
    else:
        scale, unit = _unit(max(est[r].seconds.serial for r in est.ranks))
        comp = [est[r].seconds.compute * scale for r in est.ranks]
        comm = [est[r].seconds.communication * scale for r in est.ranks]
        time.barh(labels, comp, color="#4c72b0", label="compute")
        time.barh(labels, comm, left=comp, color="#dd8452", label="communication")
        for i, r in enumerate(est.ranks):
            time.plot([est[r].seconds.overlapped * scale] * 2, [i - 0.4, i + 0.4],
                      color="black", label="all overlapped" if i == 0 else None)
        time.set_xlabel(unit)
        time.set_title(f"predicted step time on {hw.name.split(',')[0]}")
        time.legend(fontsize="small", loc="lower right")
    if path is not None:
        fig.savefig(os.fspath(path), dpi=100)
    return fig


def _unit(seconds: float) -> tuple[float, str]:
    return ((1.0, "seconds") if seconds >= 1 else (1e3, "milliseconds") if seconds >= 1e-3
            else (1e6, "microseconds"))


def _byte_unit(n: float) -> tuple[int, str]:
    for k, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 2 ** (10 * k):
            return 2 ** (10 * k), unit
    return 1, "bytes"
