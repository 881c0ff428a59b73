"""Plan rules: wildcard patterns over module names -> parallel styles.

A plan is a dict like transformers' ``tp_plan`` or DTensor's ``parallelize_plan``::

    {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}

Keys name modules by their dotted names; ``*`` (and ``?``, ``[...]``) match within
one dotted component, so ``layers.*.mlp`` matches ``layers.3.mlp`` and not
``layers.3.x.mlp``. When several rules match a module, the one with fewest
wildcard components wins (an exact name beats a pattern), then the earlier one.
Values are registered style names (``functp.parallel._style``'s registry) or
``functp.Style`` objects. A module without a rule that shares a weight with one a
rule splits (a tied embedding) gets the style that splits it the same way.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Any

from torch import nn

from ..runtime._errors import ShardingError
from ..mesh._mesh import Mesh
from ..mesh._spec import P, normalize_spec
from ._style import Style, get_style

__all__ = ["match_plan", "matches_rule"]


_WILD = re.compile(r"[*?\[]")


def matches_rule(rule: str, name: str) -> bool:
    """Whether a plan's module pattern (transformers' ``tp_plan``/``ep_plan``/
    ``fsdp_plan`` keys: dotted names, ``*`` standing for one name) matches the dotted
    module or parameter ``name``. Example: ``matches_rule("layers.*.mlp", "layers.3.mlp")``."""
    r, n = rule.split(".") if rule else [], name.split(".") if name else []
    return len(r) == len(n) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n, r))


def _resolve(rule: str, value: Any) -> tuple[str, Style]:
    """(label for messages, style) for one plan entry."""
    if isinstance(value, str):
        return repr(value), get_style(value)
    if isinstance(value, Style):
        return repr(value), value
    raise ShardingError(
        f"plan rule {rule!r}: the style must be a registered name (a str) or a "
        f"functp.Style instance, got {value!r} ({type(value).__name__})")


def match_plan(module: nn.Module, plan: dict[str, Any]) -> tuple[dict[str, tuple[str, str, Style]], list[str]]:
    """Which rule of ``plan`` applies to each submodule of ``module``.

    **Returns:** ``(matched, unused)``: ``matched`` maps module names (in module
    order) to ``(rule, label, style)``; ``unused`` lists the rules that matched no
    module. Example::

        matched, unused = functp.match_plan(model, {"layers.*.mlp.down_proj": "rowwise"})
        list(matched)      # ['layers.0.mlp.down_proj', 'layers.1.mlp.down_proj']
    """
    if not isinstance(plan, dict):
        raise ShardingError(f"a plan must be a dict of module-name patterns to styles, "
                            f"got {type(plan).__name__}")
    rules = []
    for order, (rule, value) in enumerate(plan.items()):
        if not isinstance(rule, str):
            raise ShardingError(f"plan keys must be module names (str), got {rule!r}")
        label, style = _resolve(rule, value)
        wild = sum(bool(_WILD.search(c)) for c in rule.split("."))
        rules.append((wild, order, rule, label, style))
    rules.sort(key=lambda r: r[:2])
    matched, used = {}, set()
    for name, _ in module.named_modules():
        for _, _, rule, label, style in rules:
            if matches_rule(rule, name):
                matched[name] = (rule, label, style)
                used.add(rule)
                break
    return matched, [r for r in plan if r not in used]


# styles tried, in order, for a module that shares a weight with a module the plan
# splits but has no rule of its own (a tied embedding and LM head)
_TIE_CANDIDATES = {nn.Embedding: ("embedding_rowwise", "embedding_colwise"),
                   nn.Linear: ("colwise_gather_output", "colwise", "rowwise")}


def _param_specs(style: Style, mod: nn.Module, axis: str, own: dict, where: str) -> dict:
    try:
        pspecs = style.param_specs(mod, axis)
    except ShardingError as e:
        raise ShardingError(f"{where}: {e}") from None
    extra = sorted(set(pspecs) - set(own))
    if extra:
        raise ShardingError(
            f"{where}: the style gives specs for {extra}, which are not parameters of "
            f"{type(mod).__name__} (it has {sorted(own)})")
    return pspecs


def _tied_styles(module: nn.Module, matched: dict, specs: dict, canon: dict, mesh: Mesh,
                 axis: str) -> dict[str, tuple[str, str, Style]]:
    """For each module without a rule holding a weight tied to one the plan splits:
    the first style of :data:`_TIE_CANDIDATES` that splits it the same way (the
    embedding of an LM head split over the vocabulary becomes vocab-parallel), or an
    error naming both modules. Without this the module would take its block of the
    shared weight for the whole of it."""
    out: dict[str, tuple[str, str, Style]] = {}
    uses = list(module.named_parameters(remove_duplicate=False))
    # the module whose rule laid out each shared weight
    ruled = {canon[id(p)]: n.rpartition(".")[0] for n, p in uses if n.rpartition(".")[0] in matched}
    for name, p in uses:
        c = canon[id(p)]
        mname, _, short = name.rpartition(".")
        if mname in matched or mname in out or c not in ruled or not specs.get(c, P()).axes:
            continue
        mod = module.get_submodule(mname)
        cands = next((c for t, c in _TIE_CANDIDATES.items() if isinstance(mod, t)), ())
        for cand in cands:
            style = get_style(cand)
            try:
                got = style.param_specs(mod, axis).get(short)
                got = got if got is None else normalize_spec(got, mesh.axis_names, cand, p.shape)
            except ShardingError:
                continue
            if got == specs[c]:
                out[mname] = (f"tied to {ruled[c]!r}", repr(cand), style)
                break
        else:
            raise ShardingError(
                f"parameter {name!r} is tied to module {ruled[c]!r}, whose rule splits it "
                f"as {specs[c]!r}, but module {mname!r} ({type(mod).__name__}) has no rule "
                f"and no style of {list(cands)} splits it that way; add a rule "
                f"for {mname!r} that does, or untie the weights")
    return out
