"""``functp.pipeline``: a model's stages over a ``pp`` axis, its microbatches run by a
schedule's table (``_schedule``), each stage's gradients computed by the stage
itself (``_stage``), activations and gradients moved at tick ends (``_transfer``).

A call, in order:

1. the agreement: one all-gather of seven numbers per rank (microbatches, schedule,
   virtual stages, batch size, this rank's chunk count, a local error, a key of its
   shapes), so ranks that disagree raise the same ``ShardingError`` before any
   transfer. It is launched first and read at the end of the first tick, whose one
   action (the first stage's first forward) needs no peer: the exchange overlaps it;
2. the ticks of the table: at each, this rank starts its action, if any; then the
   tick's transfers (point-to-point between the pairs the table names, waited for
   where a received tensor is read; one all-to-all in the check mode). At the tick of
   a stage's first send, one all-gather of the shapes and dtypes each boundary
   carries (pp - 1 of them, ``pp * v - 1`` interleaved) - only at the first call with
   these shapes: the agreement's row carries a key of each rank's parameter and batch
   shapes, and where every rank's key is the one of the last call that ended well,
   its headers are used again (a stage whose output shape changes nevertheless is the
   shape error below, on every rank);
3. the closing all-gather: the loss (from the last stage) and any error a rank met
   during the ticks (a stage's output of another shape than its first), so that
   every rank returns the same loss or raises the same error.

(Between processes these all-gathers are point-to-point messages through the axis's
first rank: ``_transfer.gather_rows_later``.)
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import optree
import torch

from ..mesh._mesh import Mesh
from ..runtime import _world
from ..runtime._errors import ShardingError
from ._schedule import FORWARD, SCHEDULES, Schedule, pipeline_schedule
from ._run import Run
from ._transfer import gather_rows_later

__all__ = ["pipeline", "Pipeline"]

_CODES = SCHEDULES + (FORWARD,)     # the agreement's schedule column (evaluate: FORWARD)


def pipeline(stage_fn: Callable, mesh: Mesh, *, axis: str = "pp", microbatches: int,
             schedule: str = "1f1b", loss_fn: Callable, virtual_stages: int = 1,
             backward: str = "tape") -> "Pipeline":
    """A training step that runs ``stage_fn`` as the stages of a pipeline over ``axis``.

    **Arguments:** ``stage_fn(params, x)`` runs this rank's stage on one microbatch
    (``stage_fn(params, x, stage)`` where stages differ: ``stage`` is the virtual
    stage's index, an int); ``mesh`` – a :class:`Mesh` with ``axis``;
    ``microbatches`` – M, the batch is cut into M pieces on dimension 0
    (``torch.tensor_split``: any M up to the batch size); ``schedule`` – "gpipe",
    "1f1b", "interleaved" or "zero_bubble"; ``loss_fn(y, targets)`` – the last
    stage's loss of one microbatch, a mean over its rows; ``virtual_stages`` – v
    model chunks per rank (interleaved: ``params`` is a list of v chunks, chunk j of
    rank r being virtual stage ``r + j * pp``); ``backward`` – "tape" or "func" (how
    a stage is differentiated, ``pipelines/_stage.py``).

    **Returns:** a :class:`Pipeline` ``step``; ``loss, grads = step(params, inputs,
    targets)`` with ``inputs`` and ``targets`` the whole batch on every rank (the first
    stage reads the inputs, the last the targets): ``loss`` is the batch's mean loss
    on every rank, ``grads`` the gradients of that mean with respect to this rank's
    ``params`` (zeros for a parameter this stage did not use).

    Example (2 ranks, one tanh layer per stage)::

        mesh = functp.make_mesh((2,), ("pp",))
        step = functp.pipeline(lambda w, x: torch.tanh(x @ w), mesh, microbatches=4,
                               loss_fn=lambda y, t: ((y - t) ** 2).mean())
        loss, grads = step(w_of_this_stage, x, y)
    """
    if not isinstance(mesh, Mesh) or axis not in mesh.axis_names:
        raise ShardingError(f"functp.pipeline: axis={axis!r} must name an axis of the mesh "
                            f"(got mesh {mesh!r})")
    if backward not in ("tape", "func"):
        raise ShardingError(f"functp.pipeline: backward={backward!r} must be 'tape' or 'func'")
    if not callable(stage_fn) or not callable(loss_fn):
        raise ShardingError("functp.pipeline: stage_fn and loss_fn must be functions")
    table = pipeline_schedule(schedule, mesh.shape[axis], microbatches, virtual_stages)
    return Pipeline(stage_fn, mesh, axis, table, loss_fn, backward)


def _takes_stage(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(pos) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


class Pipeline:
    """A pipelined step (made by :func:`pipeline`): ``step(params, inputs, targets)``
    returns ``(loss, grads)``; ``step.evaluate(params, inputs, targets)`` the loss
    alone, forward only.

    **Attributes:** ``schedule`` – the :class:`Schedule` it runs (``.text()``,
    ``.plot()``); ``peak_saved`` – after a call, the most microbatches whose saved
    activations this rank held at once (a count the executor keeps; 0 after
    ``evaluate``); ``peak_sending`` – the most sent activations it held at once,
    each freed once the peer it went to has been heard from since.
    """

    def __init__(self, stage_fn, mesh, axis, table: Schedule, loss_fn, backward):
        self.stage_fn, self.mesh, self.axis, self.schedule = stage_fn, mesh, axis, table
        self.loss_fn, self.backward = loss_fn, backward
        self._with_stage = _takes_stage(stage_fn)
        self.peak_saved = self.peak_sending = 0
        self._forward: Schedule | None = None    # evaluate's table, made at its first call
        # keyed (rank, schedule): a training call's and an evaluation's are kept apart
        self._plans: dict = {}      # -> its transfers and actions, from the table
        self._known: dict = {}      # -> (every rank's shape key, trail, dtype)

    def __call__(self, params, inputs, targets):
        t = self.schedule
        run = self._run(t, params, inputs, targets)
        loss = run.close()          # (raises on every rank alike: nothing is kept then)
        self._known[(run.me, t.schedule)] = (run.keys, run.trail, run.dtype)
        grads = run.grads if t.schedule == "interleaved" else run.grads[0]
        return loss, grads

    def evaluate(self, params, inputs, targets) -> torch.Tensor:
        """The batch's mean loss, as the step computes it, forward only: each stage runs
        its microbatches' forwards under ``torch.no_grad`` as soon as their inputs
        arrive (GPipe's forward phase: ``pp - 1 + M * v`` ticks, interleaved with M a
        multiple of pp), keeping no activations and computing no gradient. Same
        arguments as the step, and the same agreement: a rank that evaluates while a
        peer trains raises on every rank.

        **Returns:** the loss on every rank of the pp axis.

        Example (2 ranks, one tanh layer per stage)::

            eval_loss = step.evaluate(w_of_this_stage, x_held_out, y_held_out)
        """
        t = self.schedule
        if self._forward is None:
            self._forward = Schedule(FORWARD, t.stages, t.microbatches, t.virtual_stages)
        run = self._run(self._forward, params, inputs, targets)
        loss = run.close()
        self._known[(run.me, FORWARD)] = (run.keys, run.trail, run.dtype)
        return loss

    def _run(self, t: Schedule, params, inputs, targets):
        """The agreement, then the ticks of table ``t``: the :class:`Run` to close."""
        g = self.mesh.axis_group(self.axis, "functp.pipeline")
        me, pp, v, m = g.index, t.stages, t.virtual_stages, t.microbatches
        chunks = params if self.schedule.schedule == "interleaved" else [params]
        n = _batch_size(inputs)
        local = _local_error(t, chunks, n)
        rows = gather_rows_later(
            [float(m), float(_CODES.index(t.schedule)), float(v), float(n),
             float(len(chunks)) if isinstance(chunks, list) else -1.0,
             float(local is not None), _shape_key(chunks, inputs, targets)], g)

        def agreed():
            """The rows read (after the first tick's forward, which overlaps their
            exchange: no transfer comes before them), checked: every rank's shape key,
            and the headers of the last call that ended well where those keys are its."""
            got = rows()
            _agree(got, local)
            keys = tuple(r[6] for r in got)
            known = self._known.pop((me, t.schedule), None)
            return keys, (known[1:] if known is not None and known[0] == keys else None)
        if local is not None:
            agreed()                        # (raises: this rank cannot cut the batch)
        if _world.dry_run() is not None:    # (estimate's bubble: _host_time.StepTime)
            _world.dry_run().pipelined.append((sum(a.ticks for a in t.actions[me]), t.ticks))
        run = Run(self, t, g, chunks, inputs, targets, n, agreed)
        run.ticks()
        return run


def _batch_size(inputs) -> int:
    leaves = [x for x in optree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    return int(leaves[0].shape[0]) if leaves and leaves[0].ndim else -1


def _shape_key(*trees) -> float:
    """A number for the structure, shapes and dtypes of this rank's parameters and of
    the batch (exact in float64: below 2**52)."""
    parts = []
    for tree in trees:
        leaves, spec = optree.tree_flatten(tree)
        parts.append(str(spec))
        parts += [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else type(x)
                  for x in leaves]
    return float(hash(tuple(map(str, parts))) % (1 << 52))


def _local_error(t: Schedule, chunks, n: int) -> str | None:
    if t.schedule == "interleaved" and (not isinstance(chunks, list)
                                         or len(chunks) != t.virtual_stages):
        return (f"with schedule='interleaved' and virtual_stages={t.virtual_stages}, params "
                f"must be a list of {t.virtual_stages} chunks (chunk j is virtual stage "
                f"rank + j * pp); got {type(chunks).__name__}"
                + (f" of {len(chunks)}" if isinstance(chunks, list) else ""))
    if n < t.microbatches:
        return (f"the batch has {n} rows (dimension 0 of inputs), fewer than "
                f"microbatches={t.microbatches}; give at least one row per microbatch")
    return None


def _agree(rows: list[list[float]], local: str | None) -> None:
    """Raises, on every rank alike, where the ranks' rows differ (or one failed)."""
    bad = [i for i, r in enumerate(rows) if r[5]]
    if bad:
        why = f"; this stage: {local}" if local else " (each of them raised why)"
        raise ShardingError(f"functp.pipeline: stage(s) {bad} cannot run the step{why}")
    names = ["microbatches", "schedule", "virtual_stages", "the batch size",
             "the number of parameter chunks"]
    for col, name in enumerate(names):
        vals = [r[col] for r in rows]
        if len(set(vals)) > 1:
            show = (lambda x: _CODES[int(x)]) if col == 1 else (lambda x: int(x))
            per = ", ".join(f"stage {i}: {show(x)}" for i, x in enumerate(vals))
            raise ShardingError(f"functp.pipeline: the stages disagree on {name} ({per}); "
                                f"every rank of the pp axis must call the same pipeline "
                                f"on the same batch")
