"""functp: JAX-style functional sharding for PyTorch.

A model becomes a pure function over a parameter pytree (:func:`functionalize`), a
spec per leaf says how it is split over a named mesh (:class:`P`, :func:`make_mesh`),
and :func:`shard_map` runs a per-shard program with explicit collectives whose
gradients are those of the unsharded model. See ``docs/`` for the model.
"""
from __future__ import annotations

from ._collectives import (all_gather, all_gather_invariant, all_to_all, axis_index,
                           axis_size, pcast, pmax, pmean, pmin, ppermute, psum, psum_scatter,
                           pvary)
from ._autodiff import grad, value_and_grad
from ._comm_log import CommEvent, comm_log
from ._checkpoint import full_state_dict, load, save
from ._crosscheck import debug_enabled, set_debug
from ._errors import CheckpointError, ShardingError
from ._estimate import Estimate, RankEstimate, StepTime, estimate
from ._hardware import Hardware, calibrate
from ._rank_meshes import MeshCandidate, MeshRanking, rank_meshes
from ._functional import functionalize
from ._grads import clip_by_global_norm, global_norm, reduce_unreduced
from ._interop import from_dtensor, to_dtensor
from ._mesh import Mesh, make_mesh
from ._overlap import set_overlap
from ._optim import init_optimizer_state, optimizer_specs, set_grads
from ._precision import MixedPrecision
from ._ragged import RaggedOffsets, ragged_all_to_all, ragged_offsets
from ._remat import checkpoint, checkpoint_name, remat, remat_policies
from ._plans import Parallelized, match_plan, parallelize, verify_plan
from ._shard_map import shard_map
from ._show import print_ranks, visualize_sharding
from ._simulate import simulate
from ._world import process_count, process_index
from ._reshard import global_shapes, reshard
from ._sharding import pad_to_multiple, shard, unpad, unshard
from ._spec import P
from ._styles import (Colwise, ExpertDispatch, ExpertParallel, ExpertRouter, PrepareInput,
                      ParameterRules, PrepareOutput, Replicated, Rowwise, SequenceParallel, Style,
                      TensorParallelExperts, LocalSizes,
                      VocabParallelEmbedding, register_style)

__version__ = "0.1.0"

__all__ = [
    "Mesh", "make_mesh", "P", "ShardingError", "CheckpointError",
    "functionalize", "shard", "unshard", "shard_map",
    "psum", "pmean", "pmax", "pmin", "pvary", "pcast", "all_gather", "all_gather_invariant",
    "psum_scatter", "all_to_all", "ppermute", "axis_index", "axis_size",
    "ragged_all_to_all", "ragged_offsets", "RaggedOffsets",
    "comm_log", "CommEvent", "set_debug", "debug_enabled", "set_overlap",
    "simulate", "estimate", "Estimate", "RankEstimate", "StepTime",
    "Hardware", "calibrate", "rank_meshes", "MeshRanking", "MeshCandidate", "print_ranks", "visualize_sharding", "process_index", "process_count",
    "reshard", "global_shapes", "pad_to_multiple", "unpad", "to_dtensor", "from_dtensor",
    "save", "load", "full_state_dict",
    "grad", "value_and_grad", "global_norm", "clip_by_global_norm", "reduce_unreduced", "MixedPrecision",
    "checkpoint", "remat", "checkpoint_name", "remat_policies", "optimizer_specs",
    "set_grads", "init_optimizer_state",
    "parallelize", "Parallelized", "match_plan", "verify_plan", "register_style", "Style",
    "Replicated",
    "Colwise", "Rowwise", "VocabParallelEmbedding", "SequenceParallel", "PrepareInput",
    "PrepareOutput", "ExpertRouter", "ExpertParallel", "ExpertDispatch", "TensorParallelExperts",
    "LocalSizes", "ParameterRules",
]
