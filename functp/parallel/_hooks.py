"""A planned module's work at its boundary while ``parallelize``'s ``apply`` runs: its
style's hooks where the style acts on it (:meth:`Style.acts`), and pre-hook actions
added to it; the module hooks torch calls, registered once when the plan is laid
out, for only what is there, and doing nothing outside ``apply``."""
from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from ..runtime._errors import ShardingError
from ._style import Acts, Call, Style

__all__ = ["CallState", "PlanHook"]


class CallState:
    """What the plan's hooks need during one ``apply`` call (``params`` is None
    outside one, and the hooks then do nothing)."""

    def __init__(self) -> None:
        self.params: dict | None = None
        self.exits: list | None = None
        self.stacks: dict[str, list[Call]] = {}   # a module called twice: one Call each
        # while a call's vma is recorded or replayed (parallel/_replayed): what the
        # hooks hand their work to, with ``pre(hook, m, args, kwargs)`` and ``post``
        self.vma = None
        # while a replayed call runs (parallel/_replayed): module id -> its parameters'
        # gradient launch points still to be made, and the tracker that makes them
        self.late: dict | None = None
        self.late_tracker = None


class PlanHook:
    """A planned module's work at its boundary while ``apply`` runs: the single place
    where it happens. Its style's hooks where the style acts on this module
    (:meth:`Style.acts`, asked once here), and the actions added with :meth:`add_pre`
    and :meth:`add_post`; torch's module hooks are registered only for what is there
    (a module hook, even one returning at once, takes every call of the module through
    torch's slower hook path). Outside ``apply`` it does nothing."""

    def __init__(self, name: str, mod: nn.Module, style: Style, pmap: dict[str, str],
                 axis: Any, state: CallState, axis_size: int | None = None):
        self.name, self.module, self.style, self.pmap, self.axis, self.state = (
            name, mod, style, pmap, axis, state)
        # (a style that says it has no hooks has none, whatever it overrides)
        acts = style.acts(mod, axis) if style.has_hooks() else Acts(None, None, False)
        if not isinstance(acts, Acts):
            raise ShardingError(f"{type(style).__name__}.acts on module {name!r} returned "
                                f"{acts!r}; it must return a functp Acts")
        self._pre, self._post = acts.pre, acts.post
        #: is the work at this module's boundary the identity (its style's hooks over
        #: an axis of one rank, and no action added)? A replayed call skips it: nothing
        #: there reads the vma such a move would carry (the next boundary that works,
        #: and the call's result, are tagged as recorded); a recorded call runs it
        #: under the union rule. (An attribute: it is read at every hook call.)
        self.replay_idle = acts.identity_over_one and axis_size == 1
        # a Call per call only for a style that reads its per-call parts; one per
        # module otherwise (on_exit there has no list to join: a style that says it
        # needs no call and registers an exit fails loudly)
        self._fixed = None if acts.call else Call(name, axis, {}, {}, None)
        self._paired = acts.call and acts.pre is not None and acts.post is not None
        # actions before / after the style's prepare_input, and its prepare_output
        self._pre_actions: tuple[list, list] = ([], [])
        self._post_actions: tuple[list, list] = ([], [])
        self._hooked = [False, False]       # torch's pre-hook, forward hook registered
        self._hook(self._pre is not None, self._post is not None)

    def add_pre(self, action, *, after: bool = False) -> None:
        """Runs ``action(module, args, kwargs)`` on every call of the module inside
        ``apply``, before its style's ``prepare_input`` (``after=True``: on what that
        returned), in the order added; it returns the ``(args, kwargs)`` the module
        gets instead, or None to leave them. A module whose style needs no pre-hook
        gets one now."""
        self._pre_actions[after].append(action)
        self.replay_idle = False
        self._hook(True, False)

    def add_post(self, action, *, after: bool = False) -> None:
        """Runs ``action(module, args, kwargs, output)`` on every call of the module
        inside ``apply``, before its style's ``prepare_output`` (``after=True``: on what
        that returned), in the order added; it returns the output to pass on instead,
        or None to leave it. A module whose style needs no forward hook gets one now."""
        self._post_actions[after].append(action)
        self.replay_idle = False
        self._hook(False, True)

    @property
    def acting(self) -> bool:
        """Does anything happen at this module's boundary (its style's hooks or an
        added action)?"""
        return (self._pre is not None or self._post is not None
                or any(self._pre_actions) or any(self._post_actions))

    def need_pre(self) -> None:
        """Registers torch's pre-hook, if the module has none (a replayed call lifts
        this module's input there)."""
        self._hook(True, False)

    @contextlib.contextmanager
    def watched(self):
        """Both of torch's hooks on the module while the block runs (a call whose vma
        decisions are recorded sees every planned module's boundary); those it did not
        have are removed after."""
        handles = []
        if not self._hooked[0]:
            handles.append(self.module.register_forward_pre_hook(self.pre, with_kwargs=True))
        if not self._hooked[1]:
            handles.append(self.module.register_forward_hook(self.post, with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, pre: bool, post: bool) -> None:
        if pre and not self._hooked[0]:
            self.module.register_forward_pre_hook(self.pre, with_kwargs=True)
            self._hooked[0] = True
        if post and not self._hooked[1]:
            self.module.register_forward_hook(self.post, with_kwargs=True)
            self._hooked[1] = True

    def _new_call(self, st: CallState) -> Call:
        return Call(self.name, self.axis,
                    {s: st.params[c] for s, c in self.pmap.items() if c in st.params}, {},
                    st.exits)

    def pre(self, m, args, kwargs):
        """torch's forward pre-hook (with kwargs)."""
        st = self.state
        if st.params is None:
            return None
        if st.vma is not None:
            return st.vma.pre(self, m, args, kwargs)
        return self.pre_work(m, args, kwargs)

    def pre_work(self, m, args, kwargs):
        """The actions and the style's ``prepare_input``: the new ``(args, kwargs)``,
        or None."""
        st = self.state
        before, after = self._pre_actions
        res = None
        for action in before:
            got = action(m, args, kwargs)
            if got is not None:
                res = args, kwargs = got
        if self._pre is not None:
            call = self._fixed
            if call is None:
                call = self._new_call(st)
                if self._paired:      # (prepare_output gets the same call's state)
                    st.stacks.setdefault(self.name, []).append(call)
            got = self._pre(m, args, kwargs, call)
            if got is not None:
                res = args, kwargs = got
        for action in after:
            got = action(m, args, kwargs)
            if got is not None:
                res = args, kwargs = got
        return res

    def post(self, m, args, kwargs, output):
        """torch's forward hook (with kwargs)."""
        st = self.state
        if st.params is None:
            return None
        if st.vma is not None:
            return st.vma.post(self, m, args, kwargs, output)
        return self.post_work(m, args, kwargs, output)

    def post_work(self, m, args, kwargs, output):
        """The actions and the style's ``prepare_output``: the new output, or None."""
        st = self.state
        before, after = self._post_actions
        res = None
        for action in before:
            got = action(m, args, kwargs, output)
            if got is not None:
                res = output = got
        if self._post is not None:
            call = self._fixed
            if call is None:
                call = st.stacks[self.name].pop() if self._paired else self._new_call(st)
            got = self._post(m, args, kwargs, output, call)
            if got is not None:
                res = output = got
        for action in after:
            got = action(m, args, kwargs, output)
            if got is not None:
                res = output = got
        return res
