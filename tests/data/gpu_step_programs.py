"""The steps benchmarks/gpu_step.py timed on the H200 (tests/data/gpu_step_h200.json), as
programs functp.estimate can run: the same transformers Llama (sdpa), built in bfloat16
on the device, and all five steps made on that one model, as gpu_step.py makes them
(so the plain steps run with the plan hooks parallelize() puts on its modules):

    from gpu_step_programs import CONFIGS, program
    step = program(CONFIGS["h1024 L8 4x512"], "cuda", "functp tape")   # model, batch, step
    grads = step()                                                     # one step

``step`` is one of ``VARIANTS``. A ``("dp", "tp")`` mesh of ``dp`` x 1 (1: world size
1, as on the H200; the functp steps only take a larger ``dp``, whose ranks split ``B``).
``replay=False``: functp's planned modules track every op on every call (the code the
H200 runs measured: they predate the replay of vma decisions, issue 39).
"""
import torch
import torch.nn.functional as F

VARIANTS = ("plain tape", "plain func.grad", "functp tape", "functp value_and_grad",
            "functp func.grad")
# (gpu_step.CONFIGS, the configurations the H200 rows name)
CONFIGS = {
    "8b-L2 1x2048": dict(hidden=4096, inter=14336, heads=32, kv=8, vocab=128256, layers=2,
                         B=1, T=2048, tie=False),
    "8b-L2 2x4096": dict(hidden=4096, inter=14336, heads=32, kv=8, vocab=128256, layers=2,
                         B=2, T=4096, tie=False),
    "h1024 L8 4x512": dict(hidden=1024, inter=4096, heads=16, kv=4, vocab=32000, layers=8,
                           B=4, T=512, tie=False),
    "h2048 L4 tied 2x2048": dict(hidden=2048, inter=8192, heads=16, kv=8, vocab=32000,
                                 layers=4, B=2, T=2048, tie=True),
    "host-bound h64 L8 1x8": dict(hidden=64, inter=128, heads=4, kv=2, vocab=128, layers=8,
                                  B=1, T=8, tie=False),
}


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def program(c, device, step, dtype=torch.bfloat16, replay=True, dp=1):
    import transformers

    import functp
    from functp import P
    cfg = transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv"], max_position_embeddings=max(c["T"], 64),
        attn_implementation="sdpa", tie_word_embeddings=c["tie"])
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    ids = torch.randint(c["vocab"], (c["B"], c["T"]),
                        generator=torch.Generator().manual_seed(0)).to(device)
    # the plain steps (gpu_step.plain_steps, world 1)
    apply, params = functp.functionalize(model)
    params = {k: v.detach() for k, v in params.items()}
    if step == "plain tape":
        def tape():
            _loss(model(ids, use_cache=False).logits, ids).backward()
            grads = [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return grads
        # (parallelize below hooks the modules the plain steps run through, as on the GPU)
    elif step == "plain func.grad":
        g = torch.func.grad(lambda p, i: _loss(apply(p, i, use_cache=False).logits, i))
    # the functp steps (gpu_step.functp_steps, world 1)
    mesh = functp.make_mesh((dp, 1), ("dp", "tp"), device_type=device)
    fapply, fparams, specs = functp.parallelize(model, mesh, "auto")
    fapply.replay = replay
    fparams = {k: v.detach() for k, v in fparams.items()}
    body = functp.shard_map(
        lambda p, i: functp.pmean(_loss(fapply(p, i, use_cache=False).logits, i), "dp"),
        mesh, in_specs=(specs, P("dp")), out_specs=P())
    if step == "plain tape":
        return tape
    if step == "plain func.grad":
        return lambda: g(params, ids)
    if step == "functp tape":
        leaves = {k: v.detach().clone().requires_grad_() for k, v in fparams.items()}
        names = list(leaves)
        return lambda: torch.autograd.grad(body(leaves, ids), [leaves[k] for k in names])
    if step == "functp value_and_grad":
        f = functp.value_and_grad(body)
        return lambda: f(fparams, ids)
    if step == "functp func.grad":
        f = torch.func.grad(body)
        return lambda: f(fparams, ids)
    raise ValueError(f"unknown step {step!r}")
