"""Parallel styles and plans: a torch.nn model to specs and bodies.

One module per parallelism, each importing only those before it here:
``_style`` (Style, Call, Acts, relayout, the style registry); ``_hooks`` (a planned
module's hooks during ``apply``); ``_rules`` (which plan rule applies to which
module); ``_tp`` (tensor and sequence parallelism), ``_ep`` (expert parallelism),
``_fsdp_style`` (FSDP; its gathers and prefetch in ``_fsdp_prefetch``, one flat
all-gather per group in ``_flat``); ``_hf`` (transformers' plans, style names and
DistributedConfig); ``_plans`` (a plan laid out: Parallelized, the plan families);
``_verify`` (verify_plan and its engine); ``_parallelize`` (parallelize: verify, then
lay out); ``_pretrained`` (checkpoints straight into this rank's blocks).
"""
