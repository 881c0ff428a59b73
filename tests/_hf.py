"""Tiny float64 transformers decoder LMs for the tests: one configuration for every
model type (``TINY``, plus ``EXTRA`` per type), the types that cannot be built here
(``NOT_BUILT``) or compute a part in float32 (``FLOAT32_INSIDE``), and the survey
step that runs a type under ``parallelize(model, mesh, "auto")`` against the unsharded
model, recorded and replayed (``_survey``).

Imported by test modules after ``pytest.importorskip("transformers")``: a broken
helper here fails those tests rather than skipping them.
"""
from __future__ import annotations

import warnings

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import functp
from functp import P

BATCH, SEQ, VOCAB = 4, 8, 32

# one tiny configuration for all: keys a config class does not know are kept as
# plain attributes and read by nobody. 4 query heads, 2 key/value heads of 8 (tp=2
# splits whole heads), 4 experts of which 2 per token, MLA ranks of 16.
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    attn_implementation="eager", experts_implementation="eager",   # grouped_mm: no float64
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, n_shared_experts=1,
    moe_shared_expert_intermediate_size=16, shared_intermediate_size=16,
    first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
    router_jitter_noise=0.0, dense_intermediate_size=32, intermediate_size_mlp=32,
    kv_lora_rank=16, q_lora_rank=16, o_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
    v_head_dim=8, index_head_dim=8, index_topk=4, swa_head_dim=8,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_head_dim=8,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)

_MLA = dict(qk_rope_head_dim=4, qk_nope_head_dim=4, num_key_value_heads=4, head_dim=4)
EXTRA = {    # what a type needs beyond TINY to build and run unsharded
    **{t: _MLA for t in ("axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                         "glm4_moe_lite", "glm_moe_dsa", "longcat_flash", "minicpm3", "youtu")},
    # a Mamba-2 mixer of test size (its defaults: 128 heads of 64, a state of 128, chunks
    # of 128 tokens: seconds a step in float64)
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
                       chunk_size=8),
    # activation sparsity on the first layer, as Gemma-3n's first layers have it
    "gemma3n_text": dict(num_kv_shared_layers=0, activation_sparsity_pattern=[0.95, 0.0],
                         laurel_rank=4, altup_num_inputs=2, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # Kimi's delta-rule attention with 4 heads, not its default 32 (a 64-token chunk
    # solved row by row in Python: its 2-layer step took 0.62 s, 0.10 s with 4 heads)
    "kimi_linear": dict(linear_num_heads=4),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1),
    # its causal LM builds the vision and audio embedders: tiny ones
    "phi4_multimodal": dict(
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        audio_config=dict(hidden_size=16, intermediate_size=16, num_blocks=1,
                          num_attention_heads=2, ext_pw_out_channel=16, downsample_rate=1,
                          depthwise_seperable_out_channel=16, nemo_conv_channels=16)),
    "cohere_compass_text": dict(
        layer_types=["full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}

# types whose unsharded model cannot run here as a tiny float64 model (the reason)
NOT_BUILT = {
    "llama4": "transformers maps it to Llama4ForCausalLM with the multimodal Llama4Config, "
              "which that class cannot read; llama4_text is the same model",
    "inkling2_text": "its router computes in float32 against the weight's dtype, so the "
                     "model cannot run in float64",
    "dots3_note_text": "its config validates per-layer sub-configs that a tiny config "
                       "does not reproduce",
}

# types whose models compute a part in float32 whatever the parameters' dtype (MoE
# routers' softmax, some norms): a float32 rounding of a 1e-16 difference shows as
# ~1e-7 relative there
FLOAT32_INSIDE = {
    "afmoe", "axk1", "bailing_hybrid", "deepseek_v3", "dots1", "exaone_moe", "flex_olmo",
    "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm4_moe", "hy_v3",
    "kimi_linear", "kolibri1", "minimax", "minimax_m2", "minimax_m3_vl_text", "mixtral",
    "olmo2", "olmo3", "olmo_hybrid", "olmoe", "solar_open", "deepseek_v2", "deepseek_v32",
    "axk2", "glm4_moe_lite", "glm_moe_dsa", "hy_v4", "llama4_text", "nemotron_h",
    "mimo_v2_flash", "inkling_text"}

def _types() -> list[str]:
    out = []
    for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = CONFIG_MAPPING[t]
        except (KeyError, ValueError, ImportError):
            continue
        if getattr(config, "base_model_tp_plan", None):
            out.append(t)
    return out


def _built(model_type: str, **fields):
    """The tiny model as transformers builds it, in the default dtype and unseeded: what
    an estimate's trace builds (a module made under fake tensors cannot be converted
    with .double()). (fields: a test's own changes to TINY, passed here rather than set
    on the module, which simulated ranks share)"""
    config = CONFIG_MAPPING[model_type](**{**TINY, **EXTRA.get(model_type, {}), **fields})
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return cls(config).eval()


def _build(model_type: str, **fields):
    """The tiny model in float64, the same weights on every rank."""
    torch.manual_seed(0)
    return _built(model_type, **fields).double()


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _max_error(actual: dict, expected: dict, loss, ref_loss) -> tuple[float, str]:
    """Largest error of the loss and of each gradient, relative to that tensor's
    largest entry, a gradient of pure rounding noise (1e-20 where others are 1e-2)
    measured against the largest gradient of all."""
    scale = max(g.abs().max().item() for g in expected.values())
    worst = (abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "loss")
    for k, ref in expected.items():
        err = (actual[k] - ref).abs().max().item()
        rel = err / max(ref.abs().max().item(), 1e-6 * scale)
        worst = max(worst, (rel, k))
    return worst


def _survey(model_type: str, shape: tuple, names: tuple, **fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # transformers' notes about tiny configs
        model = _build(model_type, **fields)
    mesh = functp.make_mesh(shape, names)
    dp = "dp" if "dp" in names else None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    forward = lambda run_model, p, i: run_model(p, input_ids=i, use_cache=False).logits
    ref_apply, full = functp.functionalize(model)
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: _lm_loss(forward(ref_apply, p, ids), tgt))(full)
    try:
        apply, params, specs = functp.parallelize(model, mesh, "auto")

        def local_loss(p, i, t):
            loss = _lm_loss(forward(apply, p, i), t)
            return functp.pmean(loss, dp) if dp else loss
        step = functp.shard_map(local_loss, mesh, in_specs=(specs, P(dp), P(dp)),
                                out_specs=P())
        # twice: the first call records the plan's vma decisions, the second replays
        # them (functp.Parallelized.replay) where they can be: both must be exact
        worst = (0.0, "")
        for _ in range(2):
            grads, loss = torch.func.grad_and_value(step)(
                params, *functp.shard((ids, tgt), mesh, P(dp)))
            worst = max(worst, _max_error(apply.unshard(grads), ref_grads, loss, ref_loss))
            if "replayed" not in apply.replay_status():
                break           # (a second call would track every op again, as the first)
    except functp.ShardingError as e:
        return "refused", str(e)
    return "ran", worst
