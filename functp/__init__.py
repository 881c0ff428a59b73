"""functp: JAX-style functional sharding for PyTorch.

A model becomes a pure function over a parameter pytree (:func:`functionalize`), a
spec per leaf says how it is split over a named mesh (:class:`P`, :func:`make_mesh`),
and :func:`shard_map` runs a per-shard program with explicit collectives whose
gradients are those of the unsharded model. See ``docs/`` for the model.
"""
from __future__ import annotations

from .ops._collectives import (all_gather, all_gather_invariant, all_to_all, axis_index,
                           axis_size, pcast, pmax, pmean, pmin, ppermute, psum, psum_scatter,
                           pvary)
from .training._autodiff import grad, value_and_grad
from .runtime._comm_log import CommEvent, comm_log
from .io._checkpoint import full_state_dict, load, save
from .runtime._crosscheck import debug_enabled, set_debug
from .runtime._errors import CheckpointError, ShardingError
from .tools._estimate import Estimate, RankEstimate, StepTime, estimate
from .tools._hardware import Hardware, calibrate
from .tools._rank_meshes import MeshCandidate, MeshRanking, rank_meshes
from .training._functional import functionalize
from .training._grads import clip_by_global_norm, global_norm, reduce_unreduced
from .mapping._interop import from_dtensor, to_dtensor
from .mesh._mesh import Mesh, make_mesh
from .ops._overlap import set_overlap
from .training._optim import init_optimizer_state, optimizer_specs, set_grads
from .training._optimizers import adamw, sgd
from .runtime._precision import MixedPrecision
from .ops._ragged import RaggedOffsets, ragged_all_to_all, ragged_offsets
from .training._remat import checkpoint, checkpoint_name, remat, remat_policies
from .pipelines._pipeline import Pipeline, pipeline
from .pipelines._schedule import Schedule, pipeline_schedule
from .parallel._parallelize import parallelize
from .parallel._plans import Parallelized
from .parallel._verify import verify_plan
from .parallel._rules import match_plan
from .parallel._pretrained import from_pretrained, init_blocks, save_pretrained
from .parallel._resize import resize_token_embeddings
from .mapping._shard_map import shard_map
from .tools._show import print_ranks, visualize_sharding
from .tools._simulate import simulate
from .runtime._world import process_count, process_index
from .mapping._reshard import global_shapes, reshard
from .mapping._sharding import pad_batch, pad_to_multiple, shard, unpad, unshard
from .mesh._spec import P
from .parallel._style import Style, register_style
from .parallel._ep import ExpertDispatch, ExpertParallel, ExpertRouter
from .parallel._tp import (Colwise, PrepareInput, PrepareOutput, Replicated, Rowwise,
                      SequenceParallel, VocabParallelEmbedding)
from .parallel._hf import LocalSizes, ParameterRules, TensorParallelExperts
from .parallel._fsdp_style import FullyShard
from .parallel._cp import ContextParallel
from .parallel._pp import PipelineStages
from .context_parallel._attention import attention
from .context_parallel._layout import cp_positions, cp_shard, cp_unshard

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
    "reshard", "global_shapes", "pad_to_multiple", "pad_batch", "unpad", "to_dtensor", "from_dtensor",
    "save", "load", "full_state_dict",
    "grad", "value_and_grad", "global_norm", "clip_by_global_norm", "reduce_unreduced", "MixedPrecision",
    "checkpoint", "remat", "checkpoint_name", "remat_policies", "optimizer_specs",
    "set_grads", "init_optimizer_state", "adamw", "sgd",
    "parallelize", "Parallelized", "match_plan", "verify_plan", "register_style", "Style",
    "Replicated",
    "Colwise", "Rowwise", "VocabParallelEmbedding", "SequenceParallel", "PrepareInput",
    "PrepareOutput", "ExpertRouter", "ExpertParallel", "ExpertDispatch", "TensorParallelExperts",
    "LocalSizes", "ParameterRules", "FullyShard", "ContextParallel", "PipelineStages",
    "from_pretrained", "init_blocks", "save_pretrained", "resize_token_embeddings",
    "attention", "cp_shard", "cp_unshard", "cp_positions",
    "pipeline", "Pipeline", "pipeline_schedule", "Schedule",
]
