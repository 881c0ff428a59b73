"""functp.estimate on a Llama-3-70B-shaped transformers model on 512 ranks (dp 64 x
tp 8: tp within each 8-GPU node), a batch of 8 x 2048 tokens per dp rank, bfloat16,
one torch.func.grad step: how long the estimate takes here, what it says, and the
analytic counts beside it (the code is estimate_llama8b.py's).

    python benchmarks/estimate_llama70b.py [layers]      # 80 layers by default
"""
from __future__ import annotations

import sys

from estimate_llama8b import report

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8)

if __name__ == "__main__":
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    report("Llama-3-70B shape", dict(LLAMA_70B, num_hidden_layers=layers), (64, 8), 8)
