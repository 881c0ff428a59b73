"""Train a small Llama-style language model on real text, data parallel × tensor
parallel, the way a first training script does: progress bar, tokens/s, eval loss,
a loss curve, periodic checkpoints, and resuming from one on another mesh.

    python examples/train_lm.py                     # 4 local processes, (dp=2, tp=2), < 2 min
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py
    python examples/train_lm.py --simulate          # 4 simulated ranks in this process
    python examples/train_lm.py --mesh 1x4 --resume runs/lm/step_000100 --steps 200
    python examples/train_lm.py --mesh 2x1 --cp 2 --seq 2048   # dp2 x cp2: long sequences
    python examples/train_lm.py --mesh 1x2 --pp 2               # pp2 x tp2: a pipeline
    python examples/train_lm.py --compile           # the whole step as one compiled graph

The text is the Python standard library's own source (the top-level modules, 1 MB;
the last 5 % held out for evaluation), read as bytes: the tokenizer is the identity
on bytes (vocabulary 256), so nothing is downloaded. The model is
``functp.models.Llama`` (GQA attention, rotary positions, SwiGLU), laid out by its
Megatron plan over 'tp' (heads and MLP units split, vocabulary-parallel embedding)
with the batch over 'dp'; AdamW steps on each rank's blocks after the gradients are
clipped by their global norm.

Everything goes to ``--out`` (``runs/lm``): ``metrics.jsonl`` (one line per step:
loss, tokens/s, eval loss when measured), ``step_NNNNNN/`` checkpoints (parameters,
AdamW state, the step and the metrics so far; ``functp.save`` writes them from the
blocks, ``functp.load`` reads them onto any mesh), and ``loss.png`` (needs
matplotlib: ``pip install -e ".[examples]"``; tqdm draws the progress bar, a plain
line every few steps without it). Under ``--simulate`` checkpoints are skipped:
they go through torch.distributed's default group, which simulated ranks lack.

A resumed run continues exactly where the checkpoint left off: the batches are a
function of the step number, and the optimizer is rebuilt fresh on the new mesh and
given its state by ``functp.init_optimizer_state`` + ``functp.optimizer_specs`` (the
spec tree ``functp.load`` needs; AdamW's moments are saved by parameter name, so a
pipeline's checkpoint, whose stages each number their own from 0, resumes with or
without ``--pp``), so with the same ``--steps`` (the learning-rate
schedule follows it) its losses are the uninterrupted run's up to float32 rounding
(the sums run in another order on another mesh).

``--cp N`` splits every sequence over a third mesh axis of N ranks (processes: dp x
cp x tp), in ``functp.cp_shard``'s load-balanced layout (rank i holds chunks i and
2N-1-i of 2N, ids and targets alike); each layer's attention becomes
:class:`ContextParallelAttention`, the same weights with the rotary embedding at the
tokens' own positions (``functp.cp_positions``) and ``functp.attention(...,
strategy=--cp-strategy, causal=True)`` over the whole sequence (``allgather``, the
default, ``ulysses`` or ``ring``: docs/long_sequences.md says when to pick which).
The rest of the model is per token, and the loss is the mean over dp and cp of the
ranks' means, so the run trains to the losses of the run without ``--cp`` (same
seed, same batches) up to float32 rounding, each rank's projections, MLP and norms
running on ``1/N`` of each sequence's tokens.

``--pp N`` splits the model's layers into N pipeline stages over a mesh axis ``pp``
(processes: dp x pp x tp): ``functp.parallelize`` on that mesh gives each rank its
stage (the embedding on the first, the norm and head on the last, each laid out by
the tp plan), and ``apply.pipeline(microbatches=--microbatches, schedule=--schedule)``
is the step: every rank is given the whole batch, each dp row pipes its own rows, and
the loss and gradients are the unpipelined model's. The clip's norm is the whole
model's (``functp.clip_by_global_norm(grads, 1.0, pipeline=apply)``: every stage's
gradients in it), so the run trains to the losses of the run without ``--pp`` up to
float32 rounding (``--float64``: ~1e-12). Evaluation is the step's forward only
(``step.evaluate``: no activations kept, no backward). Its checkpoint is the
stages' union (``functp.save``: one checkpoint of the whole model), which
``--resume`` reads on any mesh, with a pipeline or without. ``--cp`` and ``--compile``
are not built beside ``--pp`` yet.

``--compile [BACKEND]`` runs the whole step, ``functp.value_and_grad`` of the loss,
``functp.clip_by_global_norm`` and ``functp.adamw(...).update(..., donate=True)`` (the
arithmetic of the torch.optim.AdamW it replaces, the learning-rate schedule computed
from its step-count tensor), as one ``torch.compile(fullgraph=True)`` graph (Inductor
by default; ``aot_eager`` compiles in seconds). Its losses are the eager run's up to
float32 rounding (Inductor fuses the arithmetic in another order). Its checkpoints
hold functp.adamw's state: resume them with ``--compile``. Both flags run as
processes; ``--cp`` also under ``--simulate``. ``--float64`` trains in float64, where
the runs with and without either flag agree to ~1e-15 (tests/test_examples.py).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time

import torch

import functp
from functp import P
from functp.models import LLAMA_TP_PLAN, Llama, LlamaConfig
from functp.models.llama import LlamaAttention

NPROC = 4


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="2x2", help="dp x tp, e.g. 2x2, 1x4, 4x1 (default 2x2)")
    ap.add_argument("--steps", type=int, default=150, help="last step to train to")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, all dp ranks")
    ap.add_argument("--seq", type=int, default=128, help="tokens (bytes) per sequence")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--out", default="runs/lm", help="metrics, checkpoints and the plot")
    ap.add_argument("--resume", default=None, help="a step_NNNNNN checkpoint to resume from")
    ap.add_argument("--simulate", action="store_true", help="ranks as threads in this process")
    ap.add_argument("--cp", type=int, default=1,
                    help="context parallel: split each sequence over this many ranks "
                         "(a third mesh axis; processes: dp x cp x tp)")
    ap.add_argument("--cp-strategy", default="allgather", choices=("allgather", "ulysses", "ring"),
                    help="functp.attention's strategy over the cp axis (default allgather)")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline parallel: split the layers into this many stages "
                         "(a mesh axis; processes: dp x pp x tp)")
    ap.add_argument("--microbatches", type=int, default=4,
                    help="microbatches per step of each dp row's pipeline (with --pp)")
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "zero_bubble"),
                    help="the pipeline's schedule (with --pp; default 1f1b)")
    ap.add_argument("--float64", action="store_true",
                    help="train in float64: runs with and without --cp or --compile then "
                         "agree to ~1e-12 rather than float32's rounding")
    ap.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="the whole step (gradients, clip, functp.adamw) as one "
                         "torch.compile(fullgraph=True) graph; BACKEND defaults to inductor")
    args = ap.parse_args(argv)
    args.dp, args.tp = (int(n) for n in args.mesh.lower().split("x"))
    if args.cp < 1:
        ap.error(f"--cp {args.cp}: a number of ranks, at least 1")
    if args.cp > 1 and args.seq % (2 * args.cp):
        ap.error(f"--seq {args.seq} does not split over --cp {args.cp}: the load-balanced "
                 f"layout gives each rank two equal chunks, so use a multiple of "
                 f"{2 * args.cp}")
    if args.pp < 1 or args.microbatches < 1:
        ap.error("--pp and --microbatches: at least 1")
    if args.pp > 1 and (args.cp > 1 or args.compile):
        ap.error("--pp: --cp and --compile beside a pipeline are not built yet")
    if args.pp > args.layers:
        ap.error(f"--pp {args.pp}: more stages than the model's {args.layers} layers")
    args.nproc = args.dp * args.cp * args.pp * args.tp
    return args


# -- data: bytes of real text ---------------------------------------------------------

def load_text(limit: int = 1_000_000) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's public top-level modules,
    in name order, as a tensor of byte values (the tokens)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    chunks, size = [], 0
    for f in files:
        if os.path.basename(f).startswith("_"):      # private, some machine-specific
            continue
        with open(f, "rb") as fh:
            chunks.append(fh.read())
        size += len(chunks[-1])
        if size >= limit:
            break
    data = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch_at(tokens: torch.Tensor, step: int, batch: int, seq: int, seed: int = 0):
    """The batch of step ``step`` (a function of the step, the same on every rank, so a
    resumed run sees the batches the uninterrupted one would): ``(ids, targets)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(len(tokens) - seq - 1, (batch,), generator=g)
    rows = torch.stack([tokens[s:s + seq + 1] for s in start.tolist()])
    return rows[:, :-1], rows[:, 1:]


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- context parallelism: the sequence split over a mesh axis ---------------------------

# The mesh axis the sequence is split over. This Llama is functp's own, whose attention
# below calls functp.attention, so parallelize lays out only its tp plan and leaves
# this axis to the model (a transformers model on a mesh with "cp" would get
# functp.ContextParallel by plan: docs/long_sequences.md).
SEQ_AXIS = "cp"


def rotary_at(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """``functp.models.llama.apply_rotary`` at the tokens' own positions in the whole
    sequence (a rank holds two chunks of it: ``functp.cp_positions``), not 0..s-1."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=x.dtype) / hd)
    freqs = positions.to(x.dtype)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    a, b = x.chunk(2, dim=-1)
    return x * emb.cos() + torch.cat([-b, a], dim=-1) * emb.sin()


class ContextParallelAttention(LlamaAttention):
    """The Llama's attention (the same parameters, so the same initial model) on this
    rank's block of the sequence: rotary positions from ``functp.cp_positions``, the
    causal attention over the whole sequence by ``functp.attention``, whose gradients
    are the whole sequence's. Everything else in the model is per token."""

    def __init__(self, cfg: LlamaConfig, seq_len: int, strategy: str):
        super().__init__(cfg)
        self.seq_len, self.strategy = seq_len, strategy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        pos = functp.cp_positions(self.seq_len, axis=SEQ_AXIS)    # this rank's tokens'
        q, k = rotary_at(q, pos, self.theta), rotary_at(k, pos, self.theta)
        out = functp.attention(q, k, v, SEQ_AXIS, strategy=self.strategy, causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def split_sequences(model: Llama, cfg: LlamaConfig, seq_len: int, strategy: str) -> None:
    """Each layer's attention replaced by :class:`ContextParallelAttention`, its
    weights kept."""
    for layer in model.layers:
        cp_attn = ContextParallelAttention(cfg, seq_len, strategy)
        cp_attn.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = cp_attn


# -- progress, metrics, plot (rank 0) ---------------------------------------------------

class Progress:
    """tqdm's bar when tqdm is installed; otherwise a plain line every few steps."""

    def __init__(self, first: int, last: int, show: bool):
        self.show, self.last = show, last
        self.bar = None
        if show:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=last, initial=first, unit="step", dynamic_ncols=True)
            except ImportError:
                print("(pip install tqdm for a progress bar)")

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif self.show and (step % 10 == 0 or step == self.last):
            print(f"[{step}/{self.last}] loss {loss:.3f}  {tok_s:,.0f} tokens/s", flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)        # above the bar, which stays at the bottom
        elif self.show:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot(metrics: list[dict], path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 'no loss plot: pip install matplotlib (or pip install -e ".[examples]")'
    fig, ax = plt.subplots(figsize=(6, 4))
    tr = [m for m in metrics if "loss" in m]
    ax.plot([m["step"] for m in tr], [m["loss"] for m in tr], label="train", lw=1)
    ev = [m for m in metrics if "eval_loss" in m]
    ax.plot([m["step"] for m in ev], [m["eval_loss"] for m in ev], "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"loss curve: {path}"


# -- training ---------------------------------------------------------------------

def main(argv=None) -> bool:
    began = time.perf_counter()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    cp = args.cp > 1
    pp = args.pp > 1
    if cp:           # the batch over dp, each sequence over SEQ_AXIS, heads over tp
        mesh = functp.make_mesh((args.dp, args.cp, args.tp), ("dp", SEQ_AXIS, "tp"))
    elif pp:         # the batch over dp, the layers over pp, heads over tp
        mesh = functp.make_mesh((args.dp, args.pp, args.tp), ("dp", "pp", "tp"))
    else:
        mesh = functp.make_mesh((args.dp, args.tp), ("dp", "tp"))
    rank0 = functp.process_index() == 0
    simulated = not torch.distributed.is_initialized()     # functp.simulate's ranks
    if simulated and args.compile:
        raise SystemExit("--compile runs as processes (torchrun), not under --simulate")

    tokens = load_text()
    split = int(len(tokens) * 0.95)
    train, held_out = tokens[:split], tokens[split:]

    torch.manual_seed(0)                       # the same initial model on every rank
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=args.hidden // 8)
    model = Llama(cfg)                         # ordinary single-device torch.nn code
    if cp:
        split_sequences(model, cfg, args.seq, args.cp_strategy)
    if args.float64:
        model.double()                         # (after the swap: it copies the weights)
    apply, params, specs = functp.parallelize(model, mesh, LLAMA_TP_PLAN, axis="tp")
    batch_axes = ("dp", SEQ_AXIS) if cp else "dp"
    batch_spec = P("dp", SEQ_AXIS) if cp else P("dp")

    def local_loss(p, ids, targets):           # this rank's blocks, batch rows and tokens
        # (every rank holds as many tokens: the mean of the means is the whole mean)
        return functp.pmean(lm_loss(apply(p, ids), targets), batch_axes)

    if pp:
        # apply is this rank's stage: its step takes the whole batch on every rank and
        # returns the batch's mean loss and this stage's gradients
        pipe_step = apply.pipeline(microbatches=args.microbatches, loss_fn=lm_loss,
                                   schedule=args.schedule)
        loss_fn = pipe_step.evaluate       # (forward only: no activations kept)
    else:
        loss_fn = functp.shard_map(local_loss, mesh,
                                   in_specs=(specs, batch_spec, batch_spec), out_specs=P())

    def place(ids_targets):
        """A whole batch -> this rank's rows (and, over cp, its two chunks of each
        sequence, the same layout for ids and targets: targets were shifted before;
        a pipeline's step is given the whole batch)."""
        if pp:
            return ids_targets
        if cp:
            return functp.cp_shard(ids_targets, mesh, axis=SEQ_AXIS, spec=batch_spec)
        return functp.shard(ids_targets, mesh, batch_spec)

    warm = 20

    def lr_at(step):                           # linear warmup, then cosine to 10 %
        if step < warm:
            return args.lr * (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, args.steps - warm))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    if args.compile:
        # the whole step as one graph: functp.adamw is torch.optim.AdamW's arithmetic
        # as a pure function (torch.optim's step breaks a compiled graph on purpose),
        # its step count a tensor, so the schedule is computed from it in the graph
        def lr_of(count):                      # lr_at in torch ops; count is 0 at step 1
            step = count + 1
            t = ((step - warm) / max(1, args.steps - warm)).clamp(0.0, 1.0)
            cosine = args.lr * (0.1 + 0.9 * 0.5 * (1 + torch.cos(math.pi * t)))
            return torch.where(step < warm, args.lr * (step + 1) / warm, cosine)

        params = {k: v.detach().clone() for k, v in params.items()}
        opt = functp.adamw(lr_of, betas=(0.9, 0.95), weight_decay=0.1)
        opt_state = opt.init(params)
        value_and_grad = functp.value_and_grad(loss_fn)

        def train_step(params, opt_state, ids, targets):
            loss, grads = value_and_grad(params, ids, targets)
            grads, _ = functp.clip_by_global_norm(grads, 1.0, mesh, specs)
            # donate=True: the new parameters and moments go into the given tensors
            params, opt_state = opt.update(params, grads, opt_state, donate=True)
            return loss, params, opt_state

        compiled_step = torch.compile(train_step, fullgraph=True, backend=args.compile)
        opt_specs = opt.specs(specs)
    else:
        grad_fn = (torch.func.grad_and_value(loss_fn) if not pp else  # (grads, loss)
                   lambda p, ids, targets: pipe_step(p, ids, targets)[::-1])
        params = {k: v.clone().requires_grad_() for k, v in params.items()}
        opt = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = "functp.adamw" if args.compile else "torch.optim.AdamW"

    def adamw_by_name():
        """torch.optim.AdamW's state and its specs by parameter name: its state_dict()
        numbers the parameters from 0 on each pipeline stage, so a checkpoint of the
        stages, which keeps their union, holds the moments under the names instead
        (and so loads on a mesh with or without pp)."""
        names = list(params)                   # (opt was built over params.values())
        by_index = functp.optimizer_specs(opt, params, specs)["state"]
        return ({k: opt.state[params[k]] for k in names if opt.state.get(params[k])},
                {names[i]: s for i, s in by_index.items()})

    start, metrics = 0, []
    if args.resume:
        like = None
        if not args.compile:
            # a fresh optimizer on this mesh: give it the state a step would make, so
            # that optimizer_specs can describe it and functp.load fill it
            functp.init_optimizer_state(opt)
            moments, opt_specs = adamw_by_name()
            # (which keys this rank reads: a pipeline stage's own)
            like = {"params": {k: v.detach() for k, v in params.items()}, "opt": moments,
                    "step": 0, "metrics": ""}
        saved_by = "torch.optim.AdamW"          # (a checkpoint from before --compile)
        if os.path.exists(os.path.join(args.resume, "optimizer.txt")):
            with open(os.path.join(args.resume, "optimizer.txt")) as f:
                saved_by = f.read().strip()
        if saved_by != optimizer:
            raise SystemExit(f"{args.resume} holds {saved_by} state; resume it "
                             f"{'with' if saved_by == 'functp.adamw' else 'without'} --compile")
        layout = {"params": specs, "opt": opt_specs, "step": P(), "metrics": P()}
        state = functp.load(args.resume, mesh, layout, like=like)
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(state["params"][k])
        if args.compile:
            opt_state = state["opt"]
        else:
            for k, moments in state["opt"].items():
                opt.state[params[k]] = moments
        start, metrics = int(state["step"]), json.loads(state["metrics"])
        kept = len(state["opt"]["exp_avg"] if args.compile else state["opt"])
        if rank0:
            print(f"resumed from {args.resume} at step {start} on (dp={args.dp}, "
                  f"{f'cp={args.cp}, ' if cp else ''}{f'pp={args.pp}, ' if pp else ''}"
                  f"tp={args.tp}): parameters, and "
                  f"{'AdamW' if not args.compile else optimizer} state for {kept} of them"
                  f"{' (stage 0)' if pp else ''}")

    def evaluate() -> float:
        with torch.no_grad():
            losses = [loss_fn({k: v.detach() for k, v in params.items()},
                              *place(batch_at(held_out, i, args.batch, args.seq, seed=1))).item()
                      for i in range(4)]
        return sum(losses) / len(losses)

    def save(step: int) -> str:
        path = os.path.join(args.out, f"step_{step:06d}")
        if args.compile:
            opt_now, specs_now = opt_state, opt_specs
        else:
            opt_now, specs_now = adamw_by_name()
        layout = {"params": specs, "opt": specs_now, "step": P(), "metrics": P()}
        # rank 0's history on every rank (each rank times its own tokens/s; the stages
        # of a pipeline must save the same values)
        history = [json.dumps(metrics)]
        torch.distributed.broadcast_object_list(history, src=0)
        functp.save(path, {"params": {k: v.detach() for k, v in params.items()},
                           "opt": opt_now, "step": step, "metrics": history[0]}, mesh, layout)
        if rank0:         # which optimizer's state it is (a resume must use the same)
            with open(os.path.join(path, "optimizer.txt"), "w") as f:
                f.write(optimizer + "\n")
        return path

    if rank0:
        os.makedirs(args.out, exist_ok=True)
        n = sum(v.numel() for v in model.parameters())
        where = (f"mesh (dp={args.dp}, cp={args.cp}, tp={args.tp}), attention "
                 f"{args.cp_strategy}" if cp else
                 f"mesh (dp={args.dp}, pp={args.pp}, tp={args.tp}), {args.schedule} over "
                 f"{args.microbatches} microbatches" if pp else
                 f"mesh (dp={args.dp}, tp={args.tp})")
        print(f"{len(tokens):,} bytes of Python's standard library ({split:,} train); model "
              f"{n / 1e6:.2f}M parameters; {where}; {args.batch} x {args.seq} tokens a step"
              f"{f'; the whole step compiled ({args.compile})' if args.compile else ''}",
              flush=True)
    if start == 0:
        first_eval = evaluate()
        if rank0:
            print(f"step 0: eval loss {first_eval:.4f} (uniform over bytes: {math.log(256):.4f})",
                  flush=True)
        metrics.append({"step": 0, "eval_loss": first_eval})

    if rank0:          # the history so far (a resumed run's from its checkpoint)
        with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in metrics)
    bar = Progress(start, args.steps, rank0)
    tokens_per_step = args.batch * args.seq
    busy, seen = 0.0, 0                        # seconds spent in training steps, tokens
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        ids, targets = place(batch_at(train, step, args.batch, args.seq))
        if args.compile:
            loss, params, opt_state = compiled_step(params, opt_state, ids, targets)
        else:
            grads, loss = grad_fn({k: v.detach() for k, v in params.items()}, ids, targets)
            # (a pipeline's: the whole model's norm, every stage's gradients in it)
            grads, _ = (functp.clip_by_global_norm(grads, 1.0, pipeline=apply) if pp else
                        functp.clip_by_global_norm(grads, 1.0, mesh, specs))
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            functp.set_grads(params, grads)
            opt.step()
        row = {"step": step, "loss": loss.item()}
        if args.compile and step == start + 1:     # the first call compiles: not a step's time
            bar.write(f"compiled the whole step in {time.perf_counter() - t0:.0f} s "
                      f"(one graph: fullgraph=True)")
        else:
            busy += time.perf_counter() - t0
            seen += tokens_per_step
        tok_s = seen / busy if busy else 0.0
        row["tokens_per_s"] = round(tok_s, 1)
        if step % args.eval_every == 0 or step == args.steps:
            row["eval_loss"] = evaluate()
            bar.write(f"step {step}: loss {row['loss']:.4f}  eval loss {row['eval_loss']:.4f}  "
                      f"{tok_s:,.0f} tokens/s")
        metrics.append(row)
        if rank0:
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        bar.update(step, row["loss"], tok_s)
        if step % args.ckpt_every == 0:
            if simulated:
                if step == args.ckpt_every:
                    bar.write("(checkpoints are skipped under --simulate: functp.save needs "
                              "torchrun's process group)")
            else:
                bar.write(f"saved {save(step)}")
    bar.close()
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    if rank0:
        print(f"trained steps {start + 1}-{args.steps} in {time.perf_counter() - began:.0f} s "
              f"({busy:.0f} s in steps, {seen / max(busy, 1e-9):,.0f} tokens/s); eval loss "
              f"{evals[0]:.4f} -> {evals[-1]:.4f}")
        print(plot(metrics, os.path.join(args.out, "loss.png")))
    return evals[-1] < evals[0]


if __name__ == "__main__":
    if "RANK" in os.environ:
        sys.exit(0 if main() else 1)
    args = parse_args()
    if args.simulate:
        sys.exit(0 if all(functp.simulate(main, args.nproc, timeout=600)) else 1)
    from torch.distributed.run import main as torchrun
    torchrun(["--standalone", "--nproc-per-node", str(args.nproc),
              os.path.abspath(__file__), *sys.argv[1:]])
