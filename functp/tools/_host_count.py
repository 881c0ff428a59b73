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
counted, with everything they call. Two more detours exist only because something
is measured, and are passed through (``_through``) without being counted:

- a module's call takes torch's slow path (``Module._call_impl``'s ``inner`` and its
  check whether torch.compile traces) when any module hook is registered: the trackers' global
  hooks send every module there. Where the module would have taken the fast path
  without them (no hooks of its own, no global hook but the trackers'), the detour
  is not counted; its ``forward`` is.
- a torch function written in Python (``F.silu``, ``torch.autograd.grad``,
  ``Tensor.backward``) sees the estimate's function modes (fake devices, ``tolist``
  reads) and goes through ``handle_torch_function`` to them, and they call it again
  from its start: the detour is not counted, nor the second run of the function
  up to its ``has_torch_function`` check (its first run counted that part), and
  from there on it is the step's work, counted once.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.nn.modules import module as _module

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
# torch's code on the two detours the measuring takes (see the module's docstring)
_CALL_IMPL = torch.nn.Module._call_impl.__code__
_INNER = next(c for c in _CALL_IMPL.co_consts if getattr(c, "co_name", None) == "inner")
_IS_COMPILING = _torch_compat.compile_check_code()
_HANDLE = torch.overrides.handle_torch_function.__code__
_SPECIAL = {_INNER: 4, _IS_COMPILING: 5, _HANDLE: 6}
_CHECKS = {torch._C._has_torch_function, torch._C._has_torch_function_unary,
           torch._C._has_torch_function_variadic}
_HOOKS = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_hooks",
          "_global_forward_pre_hooks")
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
        # code -> 0 counted, 1 functp's, 2 the estimate's, 3 machinery (quiet), 4-6 maybe
        # a detour (_SPECIAL)
        self._kind: dict = {}
        self._quiet: object = None    # the machinery frame whose calls are not counted
        # the first frame entered (the program), and the latest call it made with the
        # counts when it was made: a step's Python starts there, before its first
        # operator (see ``entered``)
        self.root: Any = None
        self.latest: tuple = (None, 0, 0)     # ((id, code) of the frame, calls, ops)
        self.ops: Any = None          # an object with ``ops`` (operators so far), or None
        self._previous = None
        # frames on a measuring detour: id -> whether their Python callees are quiet
        # (their own calls and C calls are not counted; see the module's docstring)
        self._through: dict[int, bool] = {}
        # a torch function called again by an estimate's mode, until its check
        self._again: int | None = None
        self._ours: dict = {}         # type of a hook or mode -> is it the machinery's

    def _classify(self, code) -> int:
        name = code.co_filename
        # (torch's multi-grad hooks: the trackers' per-module backward hooks)
        kind = _SPECIAL.get(code)       # (4-6: counted unless on a detour)
        if kind is None:
            kind = (3 if name == _GRAPH and code.co_name in ("inner_hook", "wrapped_fn") else
                    3 if name.startswith(_QUIET) else 2 if name.startswith(_OWN) else
                    1 if name.startswith(_FUNCTP) else 0)
        self._kind[code] = kind
        return kind

    def _machinery(self, f) -> bool:
        """Is ``f`` (a hook, or a mode's ``__torch_function__``) the measuring's own?"""
        f = getattr(f, "__func__", f)
        code = getattr(f, "__code__", None)
        return code is not None and self._classify(code) in (2, 3)

    def _detour(self, frame, kind: int) -> bool:
        """Is this call (``kind`` 4-6: see ``_SPECIAL``) on a measuring detour?"""
        if kind == 6:        # handle_torch_function, to the mode on top of the stack
            n = torch._C._len_torch_function_stack()
            if not n:
                return False
            mode = type(torch._C._get_function_stack_at(n - 1))
            if mode not in self._ours:
                self._ours[mode] = self._machinery(mode.__torch_function__)
            return self._ours[mode]
        back = frame.f_back           # Module._call_impl's slow path (inner, is_compiling)
        if back is None or back.f_code is not _CALL_IMPL:
            return False
        m = back.f_locals.get("self")
        return (m is not None and not (m._backward_hooks or m._backward_pre_hooks or
                                        m._forward_hooks or m._forward_pre_hooks)
                and all(self._machinery(h) for name in _HOOKS
                        for h in getattr(_module, name).values()))

    def _profile(self, frame, event, arg) -> None:
        if self._quiet is not None:
            if event == "return" and frame is self._quiet:
                self._quiet = None
            return
        if self._again is not None:   # (a torch function's second run, up to its check)
            if (event == "c_call" and arg in _CHECKS) or (event == "return"
                                                           and id(frame) == self._again):
                self._again = None
            return
        if event == "c_call":       # (frame: the caller's)
            kind = self._kind.get(frame.f_code)
            if kind is None:
                kind = self._classify(frame.f_code)
            if kind < 2 or (kind > 3 and id(frame) not in self._through):
                self.builtin += 1
                self.functp += kind == 1
            return
        if event == "return":
            if self._through and id(frame) in self._through:
                del self._through[id(frame)]
            return
        if event != "call":
            return
        code = frame.f_code
        kind = self._kind.get(code)
        if kind is None:
            kind = self._classify(code)
        back = frame.f_back
        if self._through and back is not None and self._through.get(id(back)) and kind != 2:
            self._quiet = frame       # (handle_torch_function's own helpers)
        elif kind == 3 or (kind == 2 and code.co_name != "__torch_function__"):
            self._quiet = frame       # (the estimate's hooks: not counted, nor below)
        elif kind > 3 and self._detour(frame, kind):
            if kind == 5:
                self._quiet = frame   # (is_compiling() on the slow path)
            else:
                self._through[id(frame)] = kind == 6
        elif (kind != 2 and back is not None and self._kind.get(back.f_code) == 2
              and back.f_code.co_name == "__torch_function__"):
            # (a call an estimate's function mode passes on is the program's call
            # made a second time: counted where the program made it, and its run up
            # to its has_torch_function check is its first run's)
            self._again = id(frame)
        elif kind != 2:
            if self.root is None:
                self.root = frame
            elif back is self.root:
                # (the frame's id and code, not the frame: a frame held after it
                # returns keeps its tensors, and the estimate's peak, alive)
                self.latest = ((id(frame), code), self.total + self.builtin,
                               self.ops.ops if self.ops is not None else 0)
            self.total += 1
            self.functp += kind == 1

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
        # (entered again, e.g. for each call of a step: the last exit was seen as a
        # call into this file, never returned from while counting)
        self._quiet, self._again, self._through = None, None, {}
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
