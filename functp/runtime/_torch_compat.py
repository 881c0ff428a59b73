"""Every private torch symbol functp uses, and every difference between the torch
versions it supports, in one place.

torch promises nothing about names with an underscore (``torch._C._functorch``,
``torch.utils._python_dispatch``, gloo's ``_Options``, DCP's file format...), so a new
torch may rename or drop one. functp imports each of them here and nowhere else: a
torch that lacks one fails in this file, at ``import functp``, with
``functp needs torch.X (used for Y); torch A.B lacks it``, and
``tests/test_torch_compat.py`` checks every entry of :data:`SYMBOLS` (the lazy ones
too), one test per symbol.

Each symbol is bound once, at import, to a module-level name: a call through it costs
what the call through ``torch._C...`` cost before (no wrapper on the hot path).
Two are imported on first use instead, being slow to import: ``torch._dynamo`` by
:func:`dynamo` and :func:`stance`, and ``torch.distributed._tools``'s ``MemTracker``
(with the runtime estimator and Inductor's utilities it imports) by
:func:`mem_tracker`, at the first ``functp.estimate``: together 0.55 s of a 3.1 s
``import functp`` on the 2-core CI machine.

Supported: torch 2.11 through 2.15 (``pyproject.toml``). CI runs the whole suite on
2.11.0, 2.13.0, 2.14.1 and 2.15.0 (``.ci/run``); on 2.12.1 this test file and the
checkpoint and compile tests passed by hand (November 2026). The differences between
them that functp meets, each handled here:

- ``torch.compiler.is_compiling()``: from 2.13 true for a whole compile session; on
  2.11 and 2.12 only inside what Dynamo traces itself, not where AOTAutograd or a
  ``nonstrict_trace`` call runs Python on fake tensors. :func:`is_compiling` answers
  as 2.13 does on each, and :data:`compiling_context` makes torch's own answer true
  while a vma body runs on fake tensors there (torch.export's context; transformers'
  mask code asks ``torch.compiler.is_compiling()``).
- ``dcp.save``'s returned ``Metadata``: from 2.12 it holds the stored byte ranges
  (``storage_data``); 2.11's ``FileSystemWriter.finish`` writes them into a copy.
  :class:`MetadataWriter` puts them back.
- ``dist.set_timeout``: public from 2.14 (the private ``_set_pg_timeout`` before).
- DCP's ``TensorProperties`` gained ``strides`` in 2.15 (its pickled state has 6 fields;
  functp's loader reads the 5 it knows).

Example::

    from functp.runtime._torch_compat import unwrap_functorch
    seen = []
    torch.func.grad(lambda x: (seen.append(unwrap_functorch(x)), x.sum())[1])(torch.ones(2))
    type(seen[0]) is torch.Tensor      # True: the plain tensor under grad's wrapper
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
import torch.distributed as dist

# (dotted name, what functp uses it for), in the order bound below
SYMBOLS: list[tuple[str, str]] = []


class TorchIncompatible(ImportError):
    """This torch lacks a private symbol functp needs."""


def resolve(path: str, why: str) -> Any:
    """torch's object at the dotted ``path`` (modules imported as needed); a
    :class:`TorchIncompatible` naming it, its use and this torch's version if absent."""
    parts = path.split(".")
    obj, i = None, len(parts)
    while i > 0:                      # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except Exception:       # noqa: BLE001 - not a module (torch.ops's namespaces)
            i -= 1
    try:
        if obj is None:
            raise AttributeError(parts[0])
        for name in parts[i:]:
            obj = getattr(obj, name)
    except AttributeError:
        raise TorchIncompatible(f"functp needs {path} (used for {why}); torch "
                                f"{torch.__version__} lacks it") from None
    return obj


def _need(path: str, why: str) -> Any:
    SYMBOLS.append((path, why))
    return resolve(path, why)


def _lazy(path: str, why: str) -> str:
    """Recorded now, resolved at first use (an import too slow for ``import functp``)."""
    SYMBOLS.append((path, why))
    return path


# -- functorch (torch.func's C++ transforms) ---------------------------------------------
_WHY_UNWRAP = "seeing the tensor under torch.func's grad/vmap wrappers"
is_functorch_wrapped = _need("torch._C._functorch.is_functorch_wrapped_tensor", _WHY_UNWRAP)
get_unwrapped = _need("torch._C._functorch.get_unwrapped", _WHY_UNWRAP)
is_batched = _need("torch._C._functorch.is_batchedtensor", _WHY_UNWRAP)
maybe_get_level = _need("torch._C._functorch.maybe_get_level",
                        "the torch.func level a body's tensors live at (vma tags)")
peek_interpreter_stack = _need("torch._C._functorch.peek_interpreter_stack",
                               "the torch.func transform a collective runs under")
layer_stack_depth = _need("torch._C._functorch.get_dynamic_layer_stack_depth",
                          "whether torch.func transforms are active (grad, checkpoint)")
TransformGrad = _need("torch._C._functorch.TransformType.Grad",
                      "whether gradient buckets may wait for a body's entry (one grad level)")
single_level_allowed = _need(
    "torch._C._functorch.get_single_level_autograd_function_allowed",
    "running a collective's autograd.Function at one torch.func level")
set_single_level_allowed = _need(
    "torch._C._functorch.set_single_level_autograd_function_allowed",
    "running a collective's autograd.Function at one torch.func level")
SingleLevelFunction = _need("torch.autograd.function._SingleLevelFunction",
                            "a collective's rule at one torch.func level")
will_engine_execute_node = _need("torch._C._will_engine_execute_node",
                                 "whether this backward reaches a body's entry (gradient buckets)")
reparametrize_module = _need("torch.nn.utils.stateless._reparametrize_module",
                             "functp.checkpoint's recompute inside functional_call")
top_saved_tensors_hooks = _need("torch._C._autograd._top_saved_tensors_default_hooks",
                                "whether FSDP's free_full_weight runs inside other "
                                "saved-tensor hooks (a checkpointed region)")
DisableFuncTorch = _need("torch._C._DisableFuncTorch",
                         "plain tensors under torch.func (printing, fingerprints, rng)")

# -- foreach ops: one call over a list of tensors (functp.adamw / sgd), which Inductor
# fuses into few kernels and CUDA launches as few; the same ops torch.optim's foreach
# steps use
_WHY_FOREACH = "functp.adamw and functp.sgd's update over a list of blocks"
foreach_add = _need("torch._foreach_add", _WHY_FOREACH)
foreach_add_ = _need("torch._foreach_add_", _WHY_FOREACH)
foreach_mul = _need("torch._foreach_mul", _WHY_FOREACH)
foreach_mul_ = _need("torch._foreach_mul_", _WHY_FOREACH)
foreach_div = _need("torch._foreach_div", _WHY_FOREACH)
foreach_div_ = _need("torch._foreach_div_", _WHY_FOREACH)
foreach_sub = _need("torch._foreach_sub", _WHY_FOREACH)
foreach_sub_ = _need("torch._foreach_sub_", _WHY_FOREACH)
foreach_lerp = _need("torch._foreach_lerp", _WHY_FOREACH)
foreach_lerp_ = _need("torch._foreach_lerp_", _WHY_FOREACH)
foreach_addcmul_ = _need("torch._foreach_addcmul_", _WHY_FOREACH)
foreach_sqrt = _need("torch._foreach_sqrt", _WHY_FOREACH)
foreach_maximum = _need("torch._foreach_maximum", _WHY_FOREACH)
foreach_maximum_ = _need("torch._foreach_maximum_", _WHY_FOREACH)


def unwrap_functorch(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every torch.func wrapper (grad's, vmap's, functionalize's:
    ``is_functorch_wrapped_tensor`` is true for each): what dispatch modes see. A
    batched value comes out with its batch dimension."""
    while is_functorch_wrapped(x):
        x = get_unwrapped(x)
    return x


# -- autograd and dispatch internals ------------------------------------------------------
BelowAutograd = _need("torch._C._AutoDispatchBelowAutograd",
                      "a collective's kernel where no gradient is needed")
is_fwd_grad_enabled = _need("torch._C._is_fwd_grad_enabled", "a collective's double backward")
set_grad_enabled = _need("torch._C._set_grad_enabled", "a collective's double backward")
set_fwd_grad_enabled = _need("torch._C._set_fwd_grad_enabled", "a collective's double backward")
current_graph_task_id = _need("torch._C._current_graph_task_id",
                              "telling forward from backward (the check mode)")
forward_ad = torch.autograd.forward_ad
_need("torch.autograd.forward_ad._current_level",
      "whether forward-mode AD is active (read as forward_ad._current_level)")
BackwardCFunction = _need("torch.autograd.function.BackwardCFunction",
                          "a custom Function's backward node (vma hooks)")
TorchDispatchMode = _need("torch.utils._python_dispatch.TorchDispatchMode",
                          "seeing aten ops (checkpoint policies, estimate)")
disable_current_modes = _need("torch.utils._python_dispatch._disable_current_modes",
                              "host work inside estimate's fake mode")
_WHY_WAITS = "waiting on a forward collective at the first use of its result"
push_dispatch_mode = _need("torch._C._push_on_torch_dispatch_stack", _WHY_WAITS)
pop_dispatch_mode = _need("torch._C._pop_torch_dispatch_stack", _WHY_WAITS)
dispatch_stack_len = _need("torch._C._len_torch_dispatch_stack", _WHY_WAITS)
dispatch_mode_at = _need("torch._C._get_dispatch_stack_at", _WHY_WAITS)
_need("torch.utils._python_dispatch.TorchDispatchMode._should_skip_dynamo", _WHY_WAITS)

# a planned module's recorded vma decisions replayed (ops/_replay): the union rule's
# function mode taken off the stack while the module runs, put back at its hooks
_WHY_REPLAY = "running a planned module without the per-op vma mode (ops/_replay)"
push_function_mode = _need("torch._C._push_on_torch_function_stack", _WHY_REPLAY)
pop_function_mode = _need("torch._C._pop_torch_function_stack", _WHY_REPLAY)
function_stack_len = _need("torch._C._len_torch_function_stack", _WHY_REPLAY)
function_mode_at = _need("torch._C._get_function_stack_at", _WHY_REPLAY)
# transformers' outputs (ModelOutput) are registered with torch's pytree, not optree's
torch_tree_leaves = _need("torch.utils._pytree.tree_leaves", _WHY_REPLAY)
torch_tree_flatten = _need("torch.utils._pytree.tree_flatten", _WHY_REPLAY)
# the module hooks torch runs for every module (a replay's records are kept only while
# no forward hook is added or removed: parallel/_replayed)
global_forward_hooks = _need("torch.nn.modules.module._global_forward_hooks", _WHY_REPLAY)
global_forward_pre_hooks = _need("torch.nn.modules.module._global_forward_pre_hooks",
                                 _WHY_REPLAY)
# the default process group's store: where a long wait is posted (runtime/_watch)
default_store = _need("torch.distributed.distributed_c10d._get_default_store",
                      "naming ranks that wait in different functp calls")


class EagerDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` torch calls as it is,
    not through Dynamo's disable wrapper (five Python calls per operator): for a
    mode that is never pushed while torch.compile traces."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
register_pytree_constant = _need("torch.utils._pytree.register_constant",
                                 "a None stand-in passed through nonstrict_trace")
is_functional_tensor = _need("torch._is_functional_tensor",
                             "telling real tensors from traced ones under torch.compile")
FakeTensor = _need("torch._subclasses.fake_tensor.FakeTensor",
                   "telling real tensors from traced ones under torch.compile")
FakeTensorMode = _need("torch._subclasses.fake_tensor.FakeTensorMode", "functp.estimate")
_get_dispatch_mode = _need("torch._C._get_dispatch_mode", "whether a fake mode is active")
_FAKE_KEY = _need("torch._C._TorchDispatchModeKey", "whether a fake mode is active").FAKE


def under_fake_mode() -> bool:
    """Is a FakeTensorMode active (``functp.estimate``'s trace, a compile's fake run)?
    Where the tensors made now are fake, no line of a user's script runs on them."""
    return _get_dispatch_mode(_FAKE_KEY) is not None
FunctionalTensor = _need("torch._subclasses.functional_tensor.FunctionalTensor",
                         "telling real tensors from traced ones under torch.compile")
DataDependentOutputException = _need(
    "torch._subclasses.fake_tensor.DataDependentOutputException", "functp.estimate's errors")
DynamicOutputShapeException = _need(
    "torch._subclasses.fake_tensor.DynamicOutputShapeException", "functp.estimate's errors")
# whether torch decomposes an operator (its CompositeImplicitAutograd kernel), asked once
# per operator: FlopCounterMode's rule, without calling decompose to learn it cannot
can_decompose = _need("torch._ops.OpOverload._can_decompose", "functp.estimate's FLOPs")
# (resolved at the first estimate: torch.distributed._tools imports its runtime
# estimator and Inductor's utilities with it, which import functp need not pay)
_WHY_MEM = "functp.estimate's memory"
_MEM = (_lazy("torch.distributed._tools.mem_tracker.MemTracker", _WHY_MEM),
        _lazy("torch.distributed._tools.mem_tracker._MemRefType", _WHY_MEM))
# what functp.estimate's subclass overrides: checked with them (an override of a method
# this torch no longer has would never be called)
_MEM_HOOKS = tuple(_lazy(f"torch.distributed._tools.mem_tracker.MemTracker.{_m}", _WHY_MEM)
                   for _m in ("_update_and_maybe_create_winfos", "_pre_fw_hook",
                              "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook"))


def mem_tracker() -> tuple[Any, Any]:
    """``(MemTracker, _MemRefType)`` of ``torch.distributed._tools.mem_tracker``,
    imported now; a :class:`TorchIncompatible` if this torch lacks them or a method
    functp.estimate's subclass overrides."""
    for path in _MEM_HOOKS:
        resolve(path, _WHY_MEM)
    return tuple(resolve(path, _WHY_MEM) for path in _MEM)

# -- c10d: functional collectives, gloo groups made by functp.simulate -------------------
c10d_functional = torch.ops._c10d_functional
for _op in ("all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
            "all_to_all_single", "broadcast", "wait_tensor"):
    _need(f"torch.ops._c10d_functional.{_op}", "every collective functp issues")
register_process_group = _need("torch._C._distributed_c10d._register_process_group",
                               "functp.simulate's per-rank gloo groups")
unregister_process_group = _need("torch._C._distributed_c10d._unregister_process_group",
                                 "functp.simulate's per-rank gloo groups")
resolve_process_group = _need("torch.distributed.distributed_c10d._resolve_process_group",
                              "a process group from its c10d name")
GlooOptions = _need("torch.distributed.ProcessGroupGloo._Options",
                    "functp.simulate's per-rank gloo groups")
for _m in ("_register_backend", "_set_default_backend", "_set_group_name", "_get_backend"):
    _need(f"torch.distributed.ProcessGroup.{_m}", "functp.simulate's per-rank gloo groups")
_need("torch.distributed.ProcessGroup._get_sequence_number_for_group",
      "a collective's number in the check mode's errors")
# torch 2.14 made it public (the private name warns there); 2.13 has only the private one
_set_pg_timeout = getattr(dist, "set_timeout", None) or _need(
    "torch.distributed.distributed_c10d._set_pg_timeout", "a process group's timeout")


_ensure_cuda_guard = _need("torch._C._ensureCUDADeviceGuardSet",
                           "torch.compile in functp.simulate's rank threads (torch 2.11)")


def before_rank_threads() -> None:
    """Before functp.simulate starts its rank threads. On a CUDA build without a GPU,
    ``FakeTensorMode`` installs a no-op CUDA device guard at each entry; torch 2.11
    crashes the process (SIGSEGV) when two threads do it at once (``torch.compile`` in
    two simulated ranks). Installed once here, the threads find it there."""
    if not torch.cuda.is_available():
        _ensure_cuda_guard()


def gloo_backend(store, rank: int, size: int, device, timeout) -> Any:
    """A gloo backend of ``size`` ranks over ``store`` on one shared ``device``, with
    one worker thread (gloo's default is two per group: thread wake-ups on few cores)."""
    opts = GlooOptions()
    opts._devices = [device]
    opts._threads = 1
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def cpu_group(store, rank: int, size: int, backend, name: str) -> dist.ProcessGroup:
    """A process group over a gloo ``backend``, registered with c10d as ``name`` (what
    the functional collectives look a group up by)."""
    pg = dist.ProcessGroup(store, rank, size)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._set_group_name(name)
    register_process_group(name, pg)
    return pg


def set_group_timeout(name: str, timeout) -> None:
    """How long collectives of the c10d group ``name`` wait."""
    _set_pg_timeout(timeout, resolve_process_group(name))


def sequence_number(pg: dist.ProcessGroup) -> int:
    """How many collectives ``pg`` has issued (the check mode's error messages)."""
    return pg._get_sequence_number_for_group()


def backend_timeout(pg: dist.ProcessGroup, device: str):
    """The timeout of ``pg``'s backend on ``device``; raises if it has none."""
    return pg._get_backend(torch.device(device)).options._timeout


# -- DCP's file format (functp.save/load read and check .metadata themselves) -------------
dcp_metadata = _need("torch.distributed.checkpoint.metadata", "functp.load's checks")
dcp_filesystem = _need("torch.distributed.checkpoint.filesystem", "functp.load's checks")
for _c in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
           "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):
    _need(f"torch.distributed.checkpoint.metadata.{_c}", "reading a checkpoint's .metadata")
_need("torch.distributed.checkpoint.filesystem._StorageInfo",
      "reading a checkpoint's .metadata")
Metadata = dcp_metadata.Metadata
StorageMeta = dcp_metadata.StorageMeta
TensorStorageMetadata = dcp_metadata.TensorStorageMetadata
FileSystemReader = _need("torch.distributed.checkpoint.FileSystemReader", "functp.load")
FileSystemWriter = _need("torch.distributed.checkpoint.FileSystemWriter", "functp.save")


class MetadataWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose ``finish`` leaves the stored byte ranges
    (``storage_data``) in the ``Metadata`` that ``dcp.save`` returns on every rank
    (functp.save's checksums read them). torch 2.12 and later do so themselves; 2.11's
    ``finish`` writes a copy and returns the plan's metadata without them."""

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        if metadata.storage_data is None:
            metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}


DefaultLoadPlanner = _need("torch.distributed.checkpoint.DefaultLoadPlanner", "functp.load")
CheckpointException = _need("torch.distributed.checkpoint.api.CheckpointException",
                            "functp.save/load's errors")

# -- torch.compile (Dynamo) ----------------------------------------------------------------
# Is a compile session running? torch 2.13 holds ``torch.compiler.is_compiling()`` true
# for the whole session, also where AOTAutograd or a ``nonstrict_trace`` call runs Python
# on fake tensors; 2.11 and 2.12 answer true only inside what Dynamo traces itself (a
# vma body's check-mode exchange then ran on fake tensors and failed to compile). There,
# the session's compile id answers instead.
# transformers asks torch itself (``is_torchdynamo_compiling``) to keep its mask code off
# data-dependent branches: on 2.11/2.12 a transformers model's vma body failed to compile
# (GuardOnDataDependentSymNode in its packed-sequence check) until functp ran the body
# inside ``compiling_context`` there. SESSION_IS_COMPILING says whether this torch
# answers for the whole session itself.
SESSION_IS_COMPILING = hasattr(torch.compiler, "_compile_session_context")   # torch >= 2.13
if SESSION_IS_COMPILING:
    is_compiling = torch.compiler.is_compiling              # an alias: asked per collective
    compiling_context = contextlib.nullcontext
else:
    _compile_id = _need("torch._guards.CompileContext.current_compile_id",
                        "telling a compile session's fake run from an eager one (torch < 2.13)")

    def is_compiling() -> bool:
        """``torch.compiler.is_compiling()`` as torch 2.13 answers it: true for the
        whole compile session. (Traced by Dynamo, the first test is a constant True.)"""
        return torch.compiler.is_compiling() or _compile_id() is not None

    # torch.export's own context: torch.compiler.is_compiling() (and is_exporting())
    # answer True inside it, as they do for the Python Dynamo traces itself on these
    # torches (Dynamo folds both to True before torch 2.14: transformers' masks read the
    # same answers in a vma body as in the plain model compiled). torch 2.13 answers
    # is_compiling() so for a whole compile session.
    compiling_context = _need(
        "torch._export.utils._compiling_state_context",
        "torch.compiler.is_compiling() true while a vma body runs on fake tensors "
        "(torch < 2.13: transformers' mask code asks it)")


_DYNAMO = (_lazy("torch._dynamo.disable", "a shard_map body Dynamo must not trace"),
           _lazy("torch._dynamo.nonstrict_trace", "a vma body as one opaque call"))


def dynamo() -> tuple[Any, Any]:
    """``(torch._dynamo.disable, torch._dynamo.nonstrict_trace)``, imported now."""
    return tuple(resolve(p, why) for p, why in SYMBOLS if p in _DYNAMO)


_WHY_STANCE = "torch.compile'd functions run eagerly inside a vma body"
_STANCE = (_lazy("torch._dynamo.eval_frame._set_stance", _WHY_STANCE),
           _lazy("torch._dynamo.eval_frame.DynamoStance", _WHY_STANCE),
           _lazy("torch._C._dynamo.eval_frame.get_eval_frame_callback", _WHY_STANCE))


_TX = _lazy("torch._dynamo.symbolic_convert.InstructionTranslator",
             "whether Dynamo traces with fullgraph=True (a compiled body's data-dependent "
             "branch is then functp's error, not a graph break)")


def one_graph() -> bool:
    """Is Dynamo tracing now with ``fullgraph=True`` (where a graph break is an error)?
    False outside a Dynamo trace, and on a torch whose translator lacks the query."""
    try:
        tx = resolve(_TX, "fullgraph").current_tx()
    except Exception:           # noqa: BLE001 - not in a Dynamo trace (or another torch)
        return False
    return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


def stance() -> tuple[Any, Any, Any]:
    """``(_set_stance, DynamoStance, get_eval_frame_callback)`` of ``torch._dynamo``:
    the compiler's process-wide stance set and restored without the public
    ``torch.compiler.set_stance``'s context-manager wrapper, and whether a compiled
    region's frame is running (where the stance may not change)."""
    return tuple(resolve(p, why) for p, why in SYMBOLS if p in _STANCE)


def compile_check_code():
    """The code of torch's "is torch.compile tracing?" check, which a module's slow-path
    call runs: functp.estimate's host count passes over it (``tools/_host_count``)."""
    return torch.compiler.is_compiling.__code__


def mode_entry_files() -> tuple[str, ...]:
    """The files of torch's own Python through which every operator enters a Python
    dispatch mode (its Dynamo-disabled wrapper): an estimate's host count leaves them
    out, since a real eager step runs no such mode (``tools/_host_count``)."""
    import os
    root = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return root + "_compile.py", root + "_dynamo" + os.sep
