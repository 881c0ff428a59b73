"""functp's steps of the gpu-truth programs (gpu_truth_programs.py), as measured on a GPU
by benchmarks/gpu_truth.py and estimated by tests/test_estimate_gpu_truth.py.

Each builds the same transformers Llama in bfloat16 on the device and the same batch as
``gpu_truth_programs.program``, then one of functp's three steps over a world-size-1
``("dp", "tp")`` mesh through ``parallelize(model, mesh, "auto")``:

    from gpu_truth_functp_programs import program
    step = program(row["config"], "cuda", "functp tape")   # builds model, batch, step
    grads = step()                                         # one step

``step`` is ``"functp tape"`` (``torch.autograd.grad`` of the ``shard_map`` body),
``"functp value_and_grad"`` or ``"functp func.grad"`` (``torch.func.grad`` of it).
"""
import torch
import torch.nn.functional as F


def ce(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def program(c, device, step):
    import transformers

    import functp
    from functp import P
    cfg = transformers.LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
                                   num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                                   num_key_value_heads=c["kv"], max_position_embeddings=8192,
                                   attn_implementation=c["attn"], tie_word_embeddings=c["tie"])
    mesh = functp.make_mesh((1, 1), ("dp", "tp"), device_type=device)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            m = transformers.LlamaForCausalLM(cfg)
            ids = torch.randint(c["vocab"], (c["B"], c["T"]))
    finally:
        torch.set_default_dtype(old)
    apply, params, specs = functp.parallelize(m, mesh, "auto", keep_module=False)

    def local_loss(p, i):
        return functp.pmean(ce(apply(p, i, use_cache=False).logits, i), "dp")
    body = functp.shard_map(local_loss, mesh, in_specs=(specs, P("dp")), out_specs=P())
    if step == "functp tape":
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        names = list(leaves)
        return lambda: dict(zip(names, torch.autograd.grad(body(leaves, ids),
                                                           [leaves[k] for k in names])))
    params = {k: v.detach() for k, v in params.items()}
    if step == "functp value_and_grad":
        f = functp.value_and_grad(body)
        return lambda: f(params, ids)[1]
    if step == "functp func.grad":
        return lambda: torch.func.grad(body)(params, ids)
    raise ValueError(f"unknown step {step!r}")
