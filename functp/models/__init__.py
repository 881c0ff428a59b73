"""Small reference models written as ordinary single-device ``torch.nn`` code, each
with its tensor-parallel plans declared beside it as plain dicts.

Example (``torchrun --nproc-per-node 2``)::

    from functp.models import Llama, LlamaConfig, LLAMA_TP_PLAN
    model = Llama(LlamaConfig())
    apply, params, specs = functp.parallelize(model, functp.make_mesh((2,), ("tp",)), LLAMA_TP_PLAN)
"""
from __future__ import annotations

from .gpt2 import GPT2, GPT2_SP_PLAN, GPT2_TP_PLAN, GPT2Config
from .llama import (LLAMA_MOE_SP_PLAN, LLAMA_MOE_TP_PLAN, LLAMA_SP_PLAN, LLAMA_TP_PLAN, Llama,
                    LlamaConfig)

__all__ = ["GPT2", "GPT2Config", "GPT2_TP_PLAN", "GPT2_SP_PLAN",
           "Llama", "LlamaConfig", "LLAMA_TP_PLAN", "LLAMA_SP_PLAN",
           "LLAMA_MOE_TP_PLAN", "LLAMA_MOE_SP_PLAN"]
