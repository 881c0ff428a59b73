"""The host's work in a step, counted: operator calls and Python function calls.

An eager step's host time is what the interpreter and torch's dispatcher spend
issuing it. Two counts explain it on the steps measured (``benchmarks/estimate_host.py``):
the operators torch dispatches (a C++ cost each, plus a kernel launch on a GPU) and
the Python functions the step calls (the model's modules, ``functional_call``'s
re-parametrization, functp's union rule, plan hooks and gradient-ready points). One
cost per operator alone cannot fit both a plain step (~5 µs per operator on this
CPU) and a functp step of the same operators (12–20 µs per operator: functp's own
Python around each one).

:class:`PyCalls` counts Python calls with ``sys.setprofile``. Under
``functp.estimate`` the same program also runs torch's fake-tensor machinery and the
estimate's own counters, none of which a real step runs: :meth:`PyCalls.off`
switches the count off while an operator is dispatched below the estimate's top
mode (fake kernels, FLOP and memory counters), and calls made from the machinery's
own files (module hooks of the trackers, the estimate's function modes) are not
counted, with everything they call.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..runtime import _torch_compat

__all__ = ["PyCalls"]

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TOOLS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_FUNCTP = os.path.dirname(_TOOLS.rstrip(os.sep)) + os.sep
# code that runs only because something is being measured: torch's counters and
# their module hooks, fake tensors, comm_log's recorder (not counted, nor anything
# they call) and the estimate's own modes (not counted; what they call for the
# program, e.g. the backward a function mode passes on, is)
_QUIET = (_TORCH + "utils" + os.sep + "flop_counter.py",
          _TORCH + "utils" + os.sep + "module_tracker.py",
          _TORCH + "distributed" + os.sep + "_tools" + os.sep,
          _TORCH + "_subclasses" + os.sep,
          _FUNCTP + "runtime" + os.sep + "_comm_log.py",
          # (how torch enters a Python dispatch mode: its dynamo-disabled wrapper and
          # the rule lookup, per operator; a real eager step has no such mode)
          *_torch_compat.mode_entry_files(),
          _TORCH + "_library" + os.sep + "simple_registry.py",
          # (weak-keyed tables of the trackers, their entries removed as tensors die)
          _TORCH + "utils" + os.sep + "weak.py")
_GRAPH = _TORCH + "autograd" + os.sep + "graph.py"
_OWN = tuple(_TOOLS + f for f in ("_estimate.py", "_host_reads.py", "_fake_devices.py",
                                  "_host_count.py"))


class PyCalls:
    """Counts the Python function calls made while it is entered (this thread), not
    those made by measuring machinery (see the module's docstring). ``total``: calls
    of Python functions so far; ``builtin``: calls of C functions made from Python;
    ``functp``: those of either made by functp's own code (not its tools).

    Example::

        with PyCalls() as c:
            torch.nn.Linear(4, 4)(torch.ones(4))
        c.total     # Module.__call__, Linear.forward, ... (a few dozen)
    """

    def __init__(self) -> None:
        self.total = 0
        self.functp = 0
        self.builtin = 0              # calls of C functions (not part of the model)
        self._kind: dict = {}         # code -> 0 counted, 1 functp's, 2 machinery
        self._quiet: object = None    # the machinery frame whose calls are not counted
        # the first frame entered (the program), and the latest call it made with the
        # counts when it was made: a step's Python starts there, before its first
        # operator (see ``entered``)
        self.root: Any = None
        self.latest: tuple = (None, 0, 0)     # ((id, code) of the frame, calls, ops)
        self.ops: Any = None          # an object with ``ops`` (operators so far), or None
        self._previous = None

    def _classify(self, code) -> int:
        name = code.co_filename
        # (torch's multi-grad hooks: the trackers' per-module backward hooks)
        kind = (3 if name == _GRAPH and code.co_name in ("inner_hook", "wrapped_fn") else
                3 if name.startswith(_QUIET) else 2 if name.startswith(_OWN) else
                1 if name.startswith(_FUNCTP) else 0)
        self._kind[code] = kind
        return kind

    def _profile(self, frame, event, arg) -> None:
        if self._quiet is not None:
            if event == "return" and frame is self._quiet:
                self._quiet = None
            return
        if event == "c_call":       # (frame: the caller's)
            kind = self._kind.get(frame.f_code)
            if kind is None:
                kind = self._classify(frame.f_code)
            if kind < 2:
                self.builtin += 1
                self.functp += kind
            return
        if event != "call":
            return
        code = frame.f_code
        kind = self._kind.get(code)
        if kind is None:
            kind = self._classify(code)
        if kind == 3 or (kind == 2 and code.co_name != "__torch_function__"):
            self._quiet = frame       # (the estimate's hooks: not counted, nor below)
        elif kind < 2 and self._kind.get(frame.f_back.f_code if frame.f_back else None) != 2:
            # (a call an estimate's function mode passes on is the program's call
            # made a second time: counted where the program made it)
            if self.root is None:
                self.root = frame
            elif frame.f_back is self.root:
                # (the frame's id and code, not the frame: a frame held after it
                # returns keeps its tensors, and the estimate's peak, alive)
                self.latest = ((id(frame), code), self.total + self.builtin,
                               self.ops.ops if self.ops is not None else 0)
            self.total += 1
            self.functp += kind

    def entered(self) -> tuple[int, int] | None:
        """``(Python calls, operators)`` counted when the program made the call it is
        in now (the step's outermost function: a step's Python starts before its
        first operator, e.g. ``functional_call`` re-parametrizing a module), or None
        when the program runs its own code."""
        frame, py, ops = self.latest
        if frame is None:
            return None
        f = sys._getframe()
        while f is not None and (id(f), f.f_code) != frame:
            f = f.f_back
        return (py, ops) if f is not None else None

    def __enter__(self) -> "PyCalls":
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)

    @contextmanager
    def off(self) -> Iterator[None]:
        """Nothing is counted inside (an operator's dispatch below the estimate's top
        mode: fake kernels and counters a real step does not run)."""
        was = sys.getprofile()
        sys.setprofile(None)
        try:
            yield
        finally:
            sys.setprofile(was)
