"""Fine-tune a transformers causal LM from a local checkpoint folder, data parallel ×
tensor parallel, with no rank ever holding the whole model.

    python examples/finetune_hf.py CKPT                   # 4 local processes, (dp=2, tp=2)
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py CKPT
    python examples/finetune_hf.py CKPT --simulate        # 4 simulated ranks in this process
    python examples/finetune_hf.py CKPT --resume runs/ft/step_000050 --steps 100
    python examples/finetune_hf.py runs/tiny --make-tiny  # first write a tiny random Llama

``CKPT`` is a folder written by transformers' ``save_pretrained`` (``config.json`` and
safetensors). ``functp.from_pretrained`` builds the model on the meta device and reads
each rank's blocks straight from the files; the plan is the model's own
(``"auto"``: its transformers tensor-parallel plan over 'tp', the batch over 'dp').
The text is the Python standard library's source read as bytes (``train_lm.py``'s
data), each byte folded into the model's vocabulary: nothing is downloaded, and the
point is the machinery, not the language. AdamW steps on each rank's blocks after the
gradients are clipped by their global norm.

``--out`` (``runs/ft``) gets ``metrics.jsonl``, ``step_NNNNNN/`` checkpoints (blocks,
AdamW state, the step: ``functp.save``, loaded onto any mesh by ``--resume``; skipped
under ``--simulate``, which has no torch.distributed group) and, at the end,
``final/``: the fine-tuned model as a folder ``transformers.AutoModelForCausalLM.
from_pretrained`` loads on one process (``functp.save_pretrained``, each rank writing
its share of the files).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import functp
from functp import P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import Progress, batch_at, lm_loss, load_text  # noqa: E402

NPROC = 4


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a transformers save_pretrained folder")
    ap.add_argument("--mesh", default="2x2", help="dp x tp, e.g. 2x2, 1x4 (default 2x2)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--steps", type=int, default=50, help="last step to train to")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step, all dp ranks")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--out", default="runs/ft")
    ap.add_argument("--resume", default=None, help="a step_NNNNNN checkpoint to resume from")
    ap.add_argument("--simulate", action="store_true", help="ranks as threads in this process")
    ap.add_argument("--make-tiny", action="store_true",
                    help="first write a tiny random Llama to CHECKPOINT (transformers' own "
                         "save_pretrained), for trying the script out")
    args = ap.parse_args(argv)
    args.dp, args.tp = (int(n) for n in args.mesh.lower().split("x"))
    return args


def make_tiny(path: str) -> None:
    """A tiny random Llama written by transformers itself (4 heads, so tp <= 4)."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def main(argv=None) -> bool:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    mesh = functp.make_mesh((args.dp, args.tp), ("dp", "tp"), device_type=args.device)
    rank0 = functp.process_index() == 0
    simulated = not torch.distributed.is_initialized()
    apply, params, specs = functp.from_pretrained(
        args.checkpoint, mesh, dtype=getattr(torch, args.dtype), attn_implementation="eager")
    vocab = apply.module.config.vocab_size
    tokens = load_text() % vocab                   # bytes folded into the vocabulary
    batch = apply.batch_axes or None

    def local_loss(p, ids, targets):
        loss = lm_loss(apply(p, input_ids=ids, use_cache=False).logits.float(), targets)
        return functp.pmean(loss, batch) if batch else loss
    loss_fn = functp.shard_map(local_loss, mesh, in_specs=(specs, P(batch), P(batch)),
                               out_specs=P())
    grad_fn = torch.func.grad_and_value(loss_fn)
    params = {k: v.requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=0.0)
    layout = lambda: {"params": specs, "opt": functp.optimizer_specs(opt, params, specs),
                      "step": P()}
    start = 0
    if args.resume:
        functp.init_optimizer_state(opt)
        state = functp.load(args.resume, mesh, layout())
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(state["params"][k])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        if rank0:
            print(f"resumed from {args.resume} at step {start}", flush=True)
    if rank0:
        os.makedirs(args.out, exist_ok=True)
        held = sum(v.numel() for v in params.values())
        print(f"{args.checkpoint}: {type(apply.module).__name__}, this rank holds {held:,} "
              f"parameter elements ({apply.split_share:.0%} of the model's split over "
              f"tp={args.tp}); mesh (dp={args.dp}, tp={args.tp}); {args.batch} x {args.seq} "
              f"tokens a step", flush=True)
    bar = Progress(start, args.steps, rank0)
    busy, seen, losses = 0.0, 0, []
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        ids, targets = functp.shard(batch_at(tokens, step, args.batch, args.seq), mesh, P(batch))
        grads, loss = grad_fn({k: v.detach() for k, v in params.items()},
                              ids.to(mesh.device_type), targets.to(mesh.device_type))
        grads, _ = functp.clip_by_global_norm(grads, 1.0, mesh, specs)
        functp.set_grads(params, grads)
        opt.step()
        busy += time.perf_counter() - t0
        seen += args.batch * args.seq
        losses.append(loss.item())
        row = {"step": step, "loss": losses[-1], "tokens_per_s": round(seen / busy, 1)}
        if rank0:
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        bar.update(step, row["loss"], row["tokens_per_s"])
        if step % args.ckpt_every == 0 and not simulated:
            path = os.path.join(args.out, f"step_{step:06d}")
            functp.save(path, {"params": {k: v.detach() for k, v in params.items()},
                               "opt": opt.state_dict(), "step": step}, mesh, layout())
            bar.write(f"saved {path}")
    bar.close()
    final = os.path.join(args.out, "final")
    functp.save_pretrained(final, {k: v.detach() for k, v in params.items()}, specs, mesh,
                           apply.module.config)
    if rank0:
        k = max(1, len(losses) // 4)
        print(f"steps {start + 1}-{args.steps}: {seen / max(busy, 1e-9):,.0f} tokens/s; loss "
              f"{sum(losses[:k]) / k:.4f} -> {sum(losses[-k:]) / k:.4f} (first and last "
              f"quarter); fine-tuned model: {final}", flush=True)
    return all(map(math.isfinite, losses))


if __name__ == "__main__":
    if "RANK" in os.environ:
        sys.exit(0 if main() else 1)
    args = parse_args()
    if args.make_tiny and not os.path.isdir(args.checkpoint):
        make_tiny(args.checkpoint)
    if args.simulate:
        sys.exit(0 if all(functp.simulate(main, args.dp * args.tp, timeout=600)) else 1)
    from torch.distributed.run import main as torchrun
    torchrun(["--standalone", "--nproc-per-node", str(args.dp * args.tp),
              os.path.abspath(__file__), *[a for a in sys.argv[1:] if a != "--make-tiny"]])
