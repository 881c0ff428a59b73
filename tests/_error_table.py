"""The table of errors docs/troubleshooting.md shows: for each, the program (run after
``SETUP``, each entry after the ones before it, on four ranks), the exception it
raises on every rank and its message, exactly.

tests/test_errors.py runs every entry on four gloo processes and checks that each rank
raises exactly that; tests/test_docs.py checks that troubleshooting.md shows each
entry, in this order, as a block of its code and, under ``# raises:``, the exception
and message (and that the page shows no other error block).
"""
from __future__ import annotations

from dataclasses import dataclass

# what every entry may use: the page's first block (which also prints the mesh)
SETUP = '''\
import torch
import functp
from functp import P

torch.manual_seed(0)
mesh = functp.make_mesh((2, 2), ("dp", "tp"))
ident = lambda x: x
w = torch.zeros(4, 6)
'''


@dataclass(frozen=True)
class Error:
    code: str           # the program: its last statement raises
    error: str          # the exception's class name (functp.ShardingError or a subclass)
    message: str        # str() of the exception

    def shown(self) -> str:
        """What the page shows under ``# raises:``, as a traceback's last line."""
        return f"{self.error}: {self.message}\n"


_PATH = "/tmp/functp-doc-not-written"       # (no save below gets as far as writing)

ERRORS = [
    # -- specs
    Error('functp.shard_map(ident, mesh, in_specs=({"w": P("pd")},), out_specs=P())({"w": w})\n',
          "ShardingError",
          "in_specs for args[0]['w'] (shape (4, 6)): P('pd') names mesh axis 'pd', but the "
          "mesh axes ('dp', 'tp') do not include it; use one of ('dp', 'tp')"),
    Error('functp.shard(w, mesh, P("tp", "tp"))\n',
          "ShardingError",
          "specs for tree (shape (4, 6)): P('tp', 'tp') uses mesh axis 'tp' twice; a mesh "
          "axis can split at most one dimension once"),
    Error('functp.shard(w, mesh, P(None, None, "tp"))\n',
          "ShardingError",
          "specs for tree (shape (4, 6)): P(None, None, 'tp') has 3 entries but the tensor "
          "has 2 dimensions; give at most one entry per dimension"),
    Error('uneven = functp.shard(torch.zeros(5, 2), mesh, P("tp"))        # 3 rows and 2 rows\n'
          'double = functp.shard_map(lambda x: x * 2, mesh, in_specs=P("tp"), out_specs=P("tp"))\n'
          'double(uneven)\n',
          "ShardingError",
          "in_specs for args[0], blocks of a global value (shape (5, 2)): P('tp') splits "
          "dimension 0 of size 5 over ('tp',) of size 2, which does not divide it; pad it to "
          "a multiple of 2 with functp.pad_to_multiple before sharding (functp.unpad the "
          "results), or choose sizes divisible by 2: shard_map needs equal blocks on every "
          "rank, and cannot know a global size from uneven ones. For a batch whose mean you "
          "take (a data set's last batch), functp.pad_batch pads it with a 0/1 weight per row: "
          "psum of the weighted losses over psum of the weights is the exact mean (mesh "
          "Mesh(dp=2, tp=2; cpu))"),
    Error('functp.shard_map(ident, mesh, in_specs=({"w": None},), out_specs=P())({"w": w})\n',
          "ShardingError",
          "in_specs[0]['w'] is None, which is not a spec; use P() for a replicated value"),
    Error('functp.shard_map(ident, mesh, in_specs=(P(), P()), out_specs=P())(w)\n',
          "ShardingError",
          "in_specs must be a pytree prefix of the args (one spec can cover a whole "
          "subtree), but in_specs is a tuple of 2 where args is a tuple of 1; give one spec "
          "per leaf there, or a single P(...) for the whole subtree"),
    Error('from torch.distributed.tensor import Partial, Replicate\n'
          'functp.shard(w, mesh, [Partial(), Replicate()])\n',
          "ShardingError",
          "specs for tree (shape (4, 6)): Partial is not a valid input spec (placements "
          "[Partial(sum), Replicate()]); reduce the value first, or pass its local "
          "contribution with a spec that mentions 'dp' and psum it in the body"),
    # -- shard_map and collectives
    Error('functp.shard_map(ident, mesh, in_specs=P(), out_specs=P())(w, scale=2)\n',
          "ShardingError",
          "shard_map'd function '<lambda>' got keyword arguments ['scale']; pass them "
          "positionally with an in_spec each (or close over non-tensor options with "
          "functools.partial)"),
    Error('functp.psum(w, "tp")\n',
          "ShardingError",
          "functp.psum was called outside a shard_map body. Collectives name mesh axes, "
          "which are bound only while a function wrapped by functp.shard_map(fn, mesh, "
          "in_specs, out_specs) runs; call it from inside that function"),
    Error('functp.shard_map(lambda x: functp.psum(x, "x"), mesh, in_specs=P("tp"),\n'
          '                 out_specs=P("tp"))(w)\n',
          "ShardingError",
          "functp.psum('x'): unknown mesh axis 'x'; the mesh has axes ('dp', 'tp')"),
    Error('f = functp.shard_map(lambda x: functp.psum(x, "dp"), mesh, in_specs=P(),\n'
          '                     out_specs=P(), axis_names={"tp"})\n'
          'f(w)\n',
          "ShardingError",
          "functp.psum('dp'): mesh axis 'dp' is not manual in the enclosing shard_map (its "
          "axis_names are ('tp',)); values there are whole along 'dp', so there is nothing "
          "to communicate over it. Add it to axis_names, or use a nested shard_map over 'dp'"),
    Error('functp.shard_map(lambda x: functp.psum_scatter(x, "tp"), mesh, in_specs=P("tp"),\n'
          '                 out_specs=P("tp"))(torch.zeros(6, 4))\n',
          "ShardingError",
          "functp.psum_scatter over ('tp',) (size 2): scatter_dimension=0 of the value "
          "(shape (6, 4)) has size 6, but it must be exactly 2 (or pass tiled=True)"),
    Error('functp.shard_map(lambda x: functp.ppermute(x, "tp", [(0, 1), (1, 1)]), mesh,\n'
          '                 in_specs=P("tp"), out_specs=P("tp"))(w)\n',
          "ShardingError",
          "functp.ppermute: perm [(0, 1), (1, 1)] sends from or to one index twice; each "
          "source and each destination may appear at most once"),
    Error('inner = functp.shard_map(ident, mesh, in_specs=P(), out_specs=P())\n'
          'functp.shard_map(inner, mesh, in_specs=P(), out_specs=P())(w)\n',
          "ShardingError",
          "a shard_map over axes ('dp', 'tp') was called inside one that is already "
          "manual over ('dp', 'tp'); a nested shard_map takes the axes the outer one "
          "left whole: give the outer one axis_names without 'dp', or the inner one "
          "axis_names without it"),
    # -- vma
    Error('functp.shard_map(lambda x: x * 2, mesh, in_specs=P("dp"), out_specs=P())(w)\n',
          "ShardingError",
          "output varies over mesh axis 'dp' but out_specs P() says it is replicated over "
          "'dp'; reduce it with functp.psum/pmean(..., 'dp') or mention 'dp' in out_specs"),
    Error('functp.shard_map(lambda x: functp.psum(x, "dp"), mesh, in_specs=P(),\n'
          '                 out_specs=P())(w)\n',
          "ShardingError",
          "functp.psum over ('dp',): the value (shape (4, 6)) is invariant over mesh axis "
          "'dp' (every rank along it holds the same value), so summing it would multiply it "
          "by the axis size. If that product is what you mean, write x * "
          "functp.axis_size('dp'); if each rank's copy really is a separate contribution, "
          "mark it with functp.pvary(x, 'dp') first; otherwise leave out 'dp' from the axes"),
    # -- resharding, DTensor and checkpoints
    Error('rows = 3 if mesh.coordinate["tp"] == 0 else 1       # no torch.chunk gives 3 and 1\n'
          'functp.unshard(torch.zeros(rows, 6), mesh, P("tp"))\n',
          "ShardingError",
          "functp.unshard: tree (spec P('tp'), mesh Mesh(dp=2, tp=2; cpu)) has blocks of "
          "sizes [3, 1, 3, 1] along dimension 0 on the mesh's ranks (in mesh order), "
          "which are not torch.chunk-style blocks over ('tp',) of any global size; "
          "blocks must come from functp.shard/reshard/load, or pass shapes="),
    Error('other = functp.make_mesh((4,), ("x",))\n'
          'functp.shard_map(lambda x: functp.reshard(x, other, P(), P("x")), mesh,\n'
          '                 in_specs=P(), out_specs=P())(w)\n',
          "ShardingError",
          "functp.reshard inside a shard_map body over Mesh(dp=2, tp=2; cpu) was given "
          "another mesh Mesh(x=4; cpu); pass the mesh of the enclosing shard_map"),
    Error('functp.to_dtensor(functp.shard(w, mesh, P(("tp", "dp"))), mesh, P(("tp", "dp")))\n',
          "ShardingError",
          "functp.to_dtensor: tree (shape (1, 6)): P(('tp', 'dp')) splits dimension 0 "
          "over ('tp', 'dp'), against the mesh order of Mesh(dp=2, tp=2; cpu) (axes "
          "('dp', 'tp')); DTensor nests the axes of one dimension in mesh order, so it "
          "has no placements for this layout. functp.reshard it to P(('dp', 'tp')) on "
          "that dimension first"),
    Error(f'functp.save("{_PATH}", {{"a.b": w, "a": {{"b": w}}}}, mesh, P())\n',
          "ShardingError",
          "functp.save: leaves tree['a']['b'] and tree['a.b'] both become checkpoint key "
          "'a.b' (paths are joined with dots); rename one"),
    Error('functp.set_debug(True)                 # (FUNCTP_DEBUG=1)\n'
          'b = torch.full((3,), float(functp.process_index()))     # another value on every rank\n'
          f'functp.save("{_PATH}", {{"b": b}}, mesh, P())\n',
          "CheckpointError",
          "functp.save: leaf tree['b'] (key 'b') is saved under P(), replicated over ('dp', "
          "'tp') on Mesh(dp=2, tp=2; cpu), but its blocks differ: ranks [0] hold one; ranks "
          "[1] hold another; ranks [2] hold another; ranks [3] hold another [FUNCTP_DEBUG "
          f"check] ({_PATH})\nthe checkpoint would keep one rank's copy only; make them equal "
          "first (a functp.pmean/psum over ('dp', 'tp') inside the step, or a copy of one "
          "rank's value), or give it a spec that mentions 'dp' if its blocks are meant to "
          "differ"),
    Error('r = functp.process_index()\n'
          'mine = {f"layers.{r}.w": w, "state.0.exp_avg": torch.zeros(r + 1)}   '
          '# stage-numbered\n'
          f'functp.save("{_PATH}", mine, mesh, P())\n',
          "CheckpointError",
          "functp.save: the ranks save different trees (a pipeline's stages), but together "
          "they are not one checkpoint: 'state.0.exp_avg' has the shape (1,) at {'dp': 0, "
          f"'tp': 0}}, (2,) at {{'dp': 0, 'tp': 1}} ({_PATH})\neach key must be the same "
          "leaf on every rank that holds it, every block of a split leaf held by some rank. "
          "An optimizer's state_dict() numbers each stage's parameters from 0: save the "
          "states by parameter name instead (docs/pipelines.md)"),
    Error('class Config:\n'
          '    lr = 0.1\n\n'
          f'functp.save("{_PATH}", {{"w": w, "cfg": Config()}}, mesh, P())\n',
          "CheckpointError",
          "functp.save: leaf tree['cfg'] is a Config; a checkpoint keeps non-tensor "
          "leaves as data (None, bool, int, float, complex, str, bytes, torch.dtype, "
          "torch.device or torch.Size), never as a pickle "
          f"({_PATH})\nconvert it (to a str, a number or a tensor), or "
          "leave it out of the saved tree"),
    # -- plans
    Error('class Attention(torch.nn.Module):\n'
          '    def __init__(self):\n'
          '        super().__init__()\n'
          '        self.head_dim, self.k_proj = 4, torch.nn.Linear(8, 12)     # 3 heads of 4\n\n'
          'functp.parallelize(Attention(), mesh, {"k_proj": "colwise"})\n',
          "ShardingError",
          "parameter 'k_proj.weight' (shape (12, 8), spec P('tp', None)), plan rule "
          "'k_proj' -> 'colwise': dimension 0 holds 3 heads of 4 (head_dim of 'the "
          "model'), which do not split over 2 ranks of ('tp',); use a 'tp' size that "
          "divides 3, or give 'k_proj' the 'replicated' style (key/value heads of GQA "
          "often need it)"),
    Error('functp.parallelize(torch.nn.Linear(4, 5), mesh, {"": "colwise"})\n',
          "ShardingError",
          "parameter 'weight' (shape (5, 4)): P('tp', None) splits dimension 0 of size 5 "
          "over ('tp',) of size 2, which does not divide it; pad it to a multiple of 2 "
          "(a vocabulary padded so, as Megatron's make-vocab-size-divisible-by), or "
          "choose heads, experts or hidden sizes divisible by 2, or give that module the "
          "'replicated' style; plan rule '' -> 'colwise' (mesh Mesh(dp=2, tp=2; cpu))"),
    Error('model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))\n'
          'apply, params, specs = functp.parallelize(model, mesh, {"0": "colwise", "1": "rowwise"})\n'
          'torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n',
          "ShardingError",
          "linalg_vector_norm() on the .grad of '0.weight' of the parallelized Sequential: "
          "the module parallelize kept gets no gradients (apply trains the blocks it "
          "returned), so this line would read or change nothing that trains; "
          "clip_grad_norm_(model.parameters(), max_norm) would clip nothing. Over the "
          "blocks instead, `apply, params, specs = functp.parallelize(model, ...)`: "
          "grads = {k: p.grad for k, p in params.items()}; clip with `grads, norm = "
          "functp.clip_by_global_norm(grads, max_norm, mesh, specs)` and "
          "`functp.set_grads(params, grads)`; log `functp.global_norm(grads, mesh, specs)`; "
          "zero with the optimizer over the blocks (optimizer.zero_grad()). "
          "docs/porting.md shows the whole loop"),
    # -- meshes
    Error('functp.make_mesh((8,), ("x",))\n',
          "ShardingError",
          "make_mesh((8,), ('x',)): the mesh has 8 ranks but the world has 4 processes; "
          "choose a shape whose sizes multiply to 4"),
    Error('functp.make_mesh((2, 1), ("x",))\n',
          "ShardingError",
          "make_mesh((2, 1), ('x',)): 2 sizes but 1 axis names; give one name per mesh "
          "axis"),
    Error('functp.make_mesh((2, 2), ("dp", "tp"), timeout=0)\n',
          "ShardingError",
          "make_mesh: timeout must be positive, got 0"),
]
