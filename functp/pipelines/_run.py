"""One call of a pipelined step on this rank: the schedule's ticks, in order.

Keys: ``("F", vs, m)`` is the activation virtual stage ``vs`` reads for microbatch
``m``; ``("B", vs, m)`` the gradient of its output. Each rank derives from the table
which keys travel at which tick end, so sender and receiver agree without asking.

A stage that raises (its body, its loss_fn or its backward, on one rank) does not
leave its peers waiting in a recv: the rank notes the exception and runs the rest of
the table's transfers without computing, sending zeros of the agreed shapes where its
results would go, so every peer finishes the ticks (on values that are thrown away)
and learns of it at the closing all-gather, which carries the exception's text; every
rank then raises (the raising rank its own exception, with a note; the others a
ShardingError naming the stage, the microbatch and the exception). A stage that fails
before its first activation's header stops every rank at that header's all-gather.
The transfers stay paired, so the axis is usable for the next step.
"""
from __future__ import annotations

import linecache
import os

import optree
import torch

from ..ops import _context
from ..runtime import _crosscheck, _world
from ..runtime._errors import ShardingError, first_line
from . import _stage
from ._schedule import FORWARD
from ._transfer import gather_rows, ready, start

__all__ = ["Run"]

_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
_DIMS = 6            # a boundary's header: its dtype, rank and up to 6 trailing sizes
_FAILED = -2.0       # a header's dtype code: the stage raised before its first send
_KINDS = {"F": "forward", "B": "backward", "W": "weight gradient"}
_MAX_TEXT = 600      # bytes of a raised exception's description sent to the peers
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _transfers(t) -> tuple[dict, dict]:
    """Per tick end: the ``(src, dst, key)`` transfers, and the boundaries whose first
    activation is sent (``{tick: [virtual stage]}``), from the table alone."""
    pp, last = t.stages, t.stages * t.virtual_stages - 1
    moves: dict = {}
    firsts: dict = {}
    for r, acts in enumerate(t.actions):
        for a in acts:
            vs, end = r + a.chunk * pp, a.tick + a.ticks - 1
            if a.kind == "F" and vs < last:
                moves.setdefault(end, []).append((r, (vs + 1) % pp, ("F", vs + 1, a.microbatch)))
                if a.microbatch == 0:
                    firsts.setdefault(end, []).append(vs)
            elif a.kind == "B" and vs > 0:
                moves.setdefault(end, []).append((r, (vs - 1) % pp, ("B", vs - 1, a.microbatch)))
    return {k: sorted(v) for k, v in moves.items()}, firsts


class Run:
    """The state of one call: inputs cut into microbatches, what each forward saved,
    what arrived and waits to be sent, the gradients summed so far."""

    def __init__(self, step, t, g, chunks, inputs, targets, n: int, agreed=None):
        self.t = t                     # the table: the step's, or evaluate's forwards
        self.step, self.g, self.chunks, self.me = step, g, chunks, g.index
        self.last = t.stages * t.virtual_stages - 1
        self.xs, self.ys = _cut(inputs, t.microbatches), _cut(targets, t.microbatches)
        self.rows = [int(optree.tree_leaves(x)[0].shape[0]) for x in self.xs]
        self.n, self.split = n, t.schedule == "zero_bubble"
        self.forward_only = t.schedule == FORWARD
        self.typed = _typer(inputs)
        self.saved, self.inbox, self.outbox = {}, {}, {}
        self.trail: dict = {}          # virtual stage -> its output's trailing shape
        self.dtype = None              # what the transfers carry (one dtype per step)
        # (send work, tensor(s), peers, tick) not known to be complete, and the latest
        # tick whose transfer from each peer this rank has read (_release)
        self.sending: list = []
        self.heard: dict[int, int] = {}
        self.grads = [None] * len(chunks)
        self.loss = None
        self.error = None              # (what, stage, microbatch, shape) met during the ticks
        self.failed = None             # (action, virtual stage, exception) this rank raised
        plan = step._plans.get((self.me, t.schedule))   # from the table alone
        if plan is None:
            plan = step._plans[(self.me, t.schedule)] = (
                *_transfers(t), {a.tick: a for a in t.actions[self.me]})
        self.moves, self.firsts, self.mine = plan
        self.agreed = agreed           # the agreement, read by _agree(self)
        self.keys = None
        step.peak_saved = step.peak_sending = 0

    def ticks(self) -> None:
        mine = self.mine
        for tick in range(self.t.ticks):
            if tick in mine and self.failed is None:
                try:
                    self.act(mine[tick])
                except Exception as e:  # noqa: BLE001 - told to every rank at close()
                    a = mine[tick]
                    self.failed = (a, self.me + a.chunk * self.t.stages, e)
            if self.agreed is not None:
                _agree(self)            # (before the first transfer or header)
            if tick in self.firsts and _agree_shapes(self, self.firsts[tick]):
                return                  # a stage failed before its first send: close
            if tick in self.moves:
                _transfer(self, self.moves[tick], tick)

    def call(self, vs: int, mb: int):
        fn, with_stage, loss_fn = self.step.stage_fn, self.step._with_stage, self.step.loss_fn
        y_mb = self.ys[mb]

        def run(p, x):
            y = fn(p, x, vs) if with_stage else fn(p, x)
            return loss_fn(y, y_mb) if vs == self.last else y
        return run

    def act(self, a) -> None:
        vs, key = self.me + a.chunk * self.t.stages, (a.chunk, a.microbatch)
        mode = self.step.backward
        if a.kind == "F":
            x = (self.xs[a.microbatch] if vs == 0
                 else self.received(("F", vs, a.microbatch)))
            out = self.forward(vs, a, x)
            if vs == self.last:
                self.add_loss(out, vs, a.microbatch)
            else:
                self.outbox[("F", vs + 1, a.microbatch)] = out.detach() if isinstance(
                    out, torch.Tensor) else out
        elif a.kind == "B":
            s = self.saved[key] if self.split else self.saved.pop(key)
            ct = (torch.tensor(self.rows[a.microbatch] / self.n, dtype=s.out.dtype)
                  if vs == self.last else self.received(("B", vs, a.microbatch)))
            if ct.shape != s.out.shape:     # a loss or output of the wrong shape, noted
                ct = torch.zeros_like(s.out)  # already: the step runs on to its error
            gx, gp = _stage.backward(s, ct, mode, self.split)
            self.add_grads(a.chunk, gp)
            if vs > 0:
                self.outbox[("B", vs - 1, a.microbatch)] = gx
        else:
            s = self.saved.pop(key)
            self.add_grads(a.chunk, _stage.weight_grad(s, self.call(vs, a.microbatch)))

    def forward(self, vs: int, a, x):
        """Virtual stage ``vs``'s output for ``a``'s microbatch (its loss on the last),
        kept with what its backward needs; under evaluate, nothing is kept."""
        call, params = self.call(vs, a.microbatch), self.chunks[a.chunk]
        if self.forward_only:
            with torch.no_grad():
                return call(params, x)
        s = self.saved[(a.chunk, a.microbatch)] = _stage.forward(
            call, params, x, self.step.backward, self.split)
        self.step.peak_saved = max(self.step.peak_saved, len(self.saved))
        return s.out

    def add_loss(self, out, vs: int, mb: int) -> None:
        if not isinstance(out, torch.Tensor) or out.ndim:
            self.note("loss", vs, mb, getattr(out, "shape", ()))
            return
        part = out.detach() * (self.rows[mb] / self.n)
        self.loss = part if self.loss is None else self.loss + part

    def add_grads(self, chunk: int, gp) -> None:
        if gp is None:
            return
        prev = self.grads[chunk]
        self.grads[chunk] = gp if prev is None else optree.tree_map(
            lambda a, b: a if b is None else a + b, prev, gp, none_is_leaf=True)

    def note(self, what: str, vs: int, mb: int, shape) -> None:
        if self.error is None:
            self.error = (what, vs, mb, tuple(shape))

    def shape_of(self, key) -> tuple:
        kind, vs, mb = key
        return (self.rows[mb], *self.trail[vs - 1 if kind == "F" else vs])

    def received(self, key):
        """What arrived for ``key``, once its receive has completed; the sends it
        proves complete are released (:func:`_release`)."""
        x, waits, peer, tick = self.inbox.pop(key)
        x = ready(x, waits)
        if peer is not None and tick > self.heard.get(peer, -1):
            self.heard[peer] = tick
            _release(self)
        return x

    def drain(self) -> None:
        """Waits for every send, and for the receives a rank that raised never read:
        the step's transfers end with it."""
        for work, *_ in self.sending:
            work.wait()
        for x, waits, *_ in self.inbox.values():
            ready(x, waits)
        self.sending, self.inbox = [], {}

    def close(self) -> torch.Tensor:
        """The closing all-gather: the loss to every rank, any rank's error to all."""
        _agree(self)
        self.drain()
        err = self.error
        shape = list(err[3])[:4] if err else []
        row = [float(self.loss) if self.loss is not None else 0.0,
               float(self.loss is not None),
               {"shape": 1.0, "loss": 2.0}[err[0]] if err else 0.0,
               float(err[1]) if err else 0.0, float(err[2]) if err else 0.0,
               float(len(shape))] + [float(d) for d in shape] + [0.0] * (4 - len(shape))
        text = b""
        if self.failed is not None:
            a, vs, e = self.failed
            text = _describe(e).encode()[:_MAX_TEXT]
            row += [1.0, float(vs), float(a.microbatch), float("FBW".index(a.kind)),
                    float(len(text))]
        else:
            row += [0.0] * 5
        rows = gather_rows(row, self.g)
        if any(got[10] for got in rows):
            _raise_failed(self, rows, text)
        for got in rows:
            if got[2]:
                _raise_noted(got, self)
        for chunk, gp in enumerate(self.grads):
            if gp is None and not self.forward_only:   # no backward ran for it: zeros
                self.grads[chunk] = optree.tree_map(torch.zeros_like, self.chunks[chunk])
        if self.loss is not None:
            return self.loss
        return _scalar(rows[self.last % self.t.stages][0], self.dtype)


def _agree(run: Run) -> None:
    """Reads the agreement (``Pipeline._run``'s: it raises where the ranks differ) and
    takes the headers of an earlier call where every rank's shapes are that call's
    (the keys, kept by ``Pipeline.__call__``)."""
    if run.agreed is None:
        return
    run.keys, known = run.agreed()
    run.agreed = None
    if known is not None:
        run.trail, run.dtype, run.firsts = dict(known[0]), known[1], {}


def _release(run: Run) -> None:
    """Waits for (and so frees the tensors of) the sends to peers this rank has since
    heard from: a peer posts a tick's receives with that tick's sends, in one batch,
    so a transfer read from it at tick t means its receives of every send up to t
    are posted, and those sends end now, without waiting on the peer. (gloo's send
    works never report completion before wait(): held until the step's end, every
    microbatch's sent activation stayed alive, past 1F1B's memory bound.)"""
    keep = []
    for s in run.sending:
        if all(run.heard.get(p, -1) >= s[3] for p in s[2]):
            s[0].wait()
        else:
            keep.append(s)
    run.sending = keep


def _transfer(run: Run, moves: list, tick: int) -> None:
    """A tick end's transfers on this rank: what it sends (zeros where it raised or its
    output has another shape: noted), receives (started, waited for where read) and
    hands itself (a stage's next virtual stage on the same rank)."""
    sends, recvs, local = [], [], []
    for src, dst, key in moves:
        if src == run.me:
            out, want = run.outbox.pop(key, None), run.shape_of(key)
            if out is None:         # this rank raised: zeros keep its peers going
                out = torch.zeros(want, dtype=run.dtype)
            elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != want
                  or out.dtype != run.dtype):
                run.note("shape", key[1] - 1 if key[0] == "F" else key[1] + 1,
                          key[2], getattr(out, "shape", ()))
                out = torch.zeros(want, dtype=run.dtype)
            (local if dst == run.me else sends).append((dst, out) if dst != run.me
                                                        else (key, out))
        elif dst == run.me:
            recvs.append((src, key))
    for key, out in local:          # (typed: what arrives varies as the batch does)
        run.inbox[key] = (run.typed(out), (), None, tick)
    if any(src != dst for src, dst, _ in moves):
        got, waits, sending = start(
            sends, [(src, run.shape_of(key)) for src, key in recvs], run.g, run.dtype)
        for (src, key), x, w in zip(recvs, got, waits):
            run.inbox[key] = (run.typed(x), w, src, tick)
        if sending:                 # (a send's tensor is kept until it completes)
            # one work a send, or one for the batch (a coalesced backend): its peers
            peers = ([(dst,) for dst, _ in sends] if len(sending) == len(sends)
                     else [tuple(dst for dst, _ in sends)] * len(sending))
            run.sending = [s for s in run.sending if not s[0].is_completed()]
            run.sending += [(w, t, p, tick) for (w, t), p in zip(sending, peers)]
            run.step.peak_sending = max(run.step.peak_sending, len(run.sending))


def _scalar(value: float, dtype) -> torch.Tensor:
    """The loss a stage that does not compute it returns: ``torch.full``, not
    ``torch.tensor``, whose fake in estimate's trace keeps its value as a constant, so
    that a collective over it (a data-parallel mean) would run for real."""
    return torch.full((), value, dtype=dtype or torch.get_default_dtype())


def _agree_shapes(run: Run, stages: list[int]) -> bool:
    """The header all-gather at a boundary's first send: every rank learns the
    shape and dtype each new boundary carries. **Returns:** True where a stage
    raised before it (every rank then goes to :meth:`Run.close`)."""
    row = [-1.0] * (3 + _DIMS)
    for vs in (vs for vs in stages if vs % run.t.stages == run.me):  # at most one
        out = run.outbox.get(("F", vs + 1, 0))
        ok = (isinstance(out, torch.Tensor) and out.dtype in _DTYPES
              and 1 <= out.ndim <= _DIMS + 1)
        dims = list(out.shape[1:]) if ok else []
        code = float(_DTYPES.index(out.dtype)) if ok else (
            _FAILED if out is None and run.failed is not None else -1.0)
        row = [float(vs), code, float(out.ndim if ok else -1)] + [float(d) for d in dims]
        row += [0.0] * (3 + _DIMS - len(row))
    rows = gather_rows(row, run.g)
    if _world.dry_run() is not None:
        rows = _published(_world.dry_run(), row, stages, run)
    if any(got[0] >= 0 and got[1] == _FAILED for got in rows):
        return True
    for r, got in enumerate(rows):
        if got[0] < 0:
            continue
        vs = int(got[0])
        if got[1] < 0:
            raise ShardingError(
                f"functp.pipeline: stage {vs} (rank {r}) returned something other than "
                f"one floating tensor of rank 1..{_DIMS + 1} with the microbatch on "
                f"dimension 0; the activation between stages must be one such tensor")
        dtype = _DTYPES[int(got[1])]
        if run.dtype is not None and dtype != run.dtype:
            raise ShardingError(
                f"functp.pipeline: stage {vs} outputs {dtype}, an earlier stage "
                f"{run.dtype}; every activation between stages must have one dtype")
        run.dtype = dtype
        run.trail[vs] = tuple(int(d) for d in got[3:2 + int(got[2])])
    return False


def _published(dry, row: list[float], stages: list[int], run: Run) -> list[list[float]]:
    """The header rows in ``functp.estimate``'s trace of one rank, which has no peers
    to gather them from: its own row is published for the ranks traced after it, and
    a boundary another stage sends is the row its rank published (traced before), or
    else the nearest earlier boundary's (the middle stages are taken to be alike,
    as the estimate takes them)."""
    # (keyed by the call's place among this trace's pipelined steps: the n-th on
    # every rank, Pipeline.__call__ having counted this one in dry.pipelined)
    board = dry.board.setdefault(("functp.pipeline", len(dry.pipelined) - 1), {})
    if row[0] >= 0:
        board[int(row[0])] = row
    out = [row]
    for vs in stages:       # (a boundary this rank receives: it holds stage vs + 1)
        if vs % run.t.stages == run.me or (vs + 1) % run.t.stages != run.me:
            continue
        known = [b for b in board if b <= vs]
        if not known:
            raise ShardingError(
                f"functp.estimate of functp.pipeline: stage {vs + 1}'s input is stage "
                f"{vs}'s output, whose shape only the trace of the rank that holds stage "
                f"{vs % run.t.stages} tells; trace that rank before this one (ranks='auto', "
                f"or ranks= listing it)")
        out.append([float(vs)] + board[max(known)][1:])
    return out


def _raise_failed(run: Run, rows: list[list[float]], text: bytes) -> None:
    """Every rank raises, after one all-gather of the raising ranks' texts."""
    width = int(max(got[14] for got in rows))
    texts = gather_rows(list(text) + [0.0] * (width - len(text)), run.g)
    parts = []
    for r, got in enumerate(rows):
        if got[10]:
            vs, mb, kind = int(got[11]), int(got[12]), "FBW"[int(got[13])]
            what = _KINDS[kind] + (" (its loss_fn included)" if kind == "F"
                                   and vs == run.last else "")
            words = bytes(int(b) for b in texts[r][:int(got[14])]).decode(errors="replace")
            parts.append(f"stage {vs} (rank {r}) raised in its {what} of microbatch "
                         f"{mb}: {words}")
    message = ("functp.pipeline: " + "; and ".join(parts) + ". Every rank of the pp "
               "axis raises this: the ranks ran the step's remaining transfers (with "
               "zeros where the raising stage's results would go, the step's results "
               "thrown away) rather than wait for it, so the axis stays usable for "
               "the next step")
    if run.failed is not None:
        e = run.failed[2]
        if hasattr(e, "add_note"):
            e.add_note(f"functp: the other ranks of the pp axis raise ShardingError: "
                       f"{message}")
        raise _crosscheck.agreed(e)
    raise _crosscheck.agreed(ShardingError(message))


def _describe(e: BaseException) -> str:
    """``Type: first line (at file:line in function: source)``, the innermost frame
    of the user's code."""
    where, tb = "", e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.startswith(_world.PACKAGE_DIR) or name.startswith(_TORCH)):
            src = linecache.getline(name, tb.tb_lineno).strip()
            where = (f" (at {os.path.basename(name)}:{tb.tb_lineno} in "
                     f"{tb.tb_frame.f_code.co_name}: {src})")
        tb = tb.tb_next
    return f"{type(e).__name__}: {first_line(e)[:300]}{where}"


def _raise_noted(got: list[float], run: Run) -> None:
    vs, mb, shape = int(got[3]), int(got[4]), tuple(int(d) for d in got[6:6 + int(got[5])])
    if got[2] == 2.0:
        raise ShardingError(
            f"functp.pipeline: the last stage's loss_fn returned shape {shape} for "
            f"microbatch {mb}; it must return a scalar, the microbatch's mean loss")
    raise ShardingError(
        f"functp.pipeline: stage {vs}'s output for microbatch {mb} has shape {shape}, "
        f"but its first microbatch's output (or an earlier call's, with the same "
        f"parameter and batch shapes) fixed {run.trail.get(vs, '?')} after the "
        f"microbatch's rows (and dtype {run.dtype}); a stage's output may change only in "
        f"its number of rows")


def _typer(inputs):
    """What marks a received activation or gradient inside a ``shard_map`` body: it
    varies over the axes the batch varies over (a data-parallel row's activations are
    its own), as a tensor computed from the batch would. Untyped (invariant), the
    stage's implicit ``pvary`` of it would sum its gradient over those axes, mixing
    the rows' microbatches. Outside a body: the tensor as it is."""
    fr = _context.top()
    tracker = fr.tracker if fr is not None else None
    if tracker is None:
        return lambda x: x
    vma = frozenset().union(*(tracker.get(t) for t in optree.tree_leaves(inputs)
                              if isinstance(t, torch.Tensor)))

    def typed(x):
        if vma and isinstance(x, torch.Tensor):
            tracker.set(x, vma)
        return x
    return typed


def _cut(tree, m: int) -> list:
    """The M microbatches of a batch tree: each tensor leaf cut on dimension 0."""
    leaves, spec = optree.tree_flatten(tree)
    parts = [torch.tensor_split(x, m) if isinstance(x, torch.Tensor) and x.ndim else [x] * m
             for x in leaves]
    return [optree.tree_unflatten(spec, [p[i] for p in parts]) for i in range(m)]
