"""Host memory while loading a pretrained checkpoint on tp=4: ``functp.from_pretrained``
(meta model, each rank reading its blocks from the safetensors files) against the way
before it (transformers' ``from_pretrained`` of the whole model on every rank, then
``functp.parallelize``, with and without ``keep_module``).

    python benchmarks/pretrained_memory.py            # 4 local processes (tp=4)

The benchmark first writes a random Llama of about 400 MiB (float32) with transformers'
own ``save_pretrained`` (sharded, with an index) to a temporary folder. Each way of
loading then runs in 4 fresh processes (so that no way inherits another's heap): every
rank returns freed memory to the system (``malloc_trim``), resets its peak resident
set (``/proc/self/clear_refs``), loads, and reports its peak (``VmHWM``) and resident
set (``VmRSS``) above where it started (after importing the model's code and building
it once on the meta device), the bytes of its blocks, and the bytes of the
distinct tensor storages it holds (blocks, and the module's non-meta parameters and
buffers). The table shows each rank's worst; results/pretrained_memory_<way>.json
keeps every rank's numbers.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _run import RESULTS, main_or_launch, save_and_leave  # noqa: E402

NPROC = 4
CONFIG = dict(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
              tie_word_embeddings=False)


def _status(field: str) -> int:
    """A ``/proc/self/status`` size field, in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")        # VmHWM := VmRSS (Linux)


def _write_model(path: str) -> int:
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(path, max_shard_size="100MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _settle() -> int:
    """The resident set once freed memory went back to the system (glibc keeps freed
    heap pages until ``malloc_trim``): what the process really holds."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status("VmRSS")


def _tensor_bytes(apply, params) -> int:
    """Bytes of the distinct tensor storages the rank holds: its blocks and whatever
    real (non-meta) parameters and buffers the module still has."""
    seen = {}
    tensors = [*params.values(), *apply.module.parameters(), *apply.module.buffers()]
    for t in tensors:
        if not t.is_meta:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _ways(path, mesh):
    import functp
    import transformers

    def transformers_then_parallelize(keep):
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        apply, params, _ = functp.parallelize(model, mesh, "auto", keep_module=keep)
        return apply, params
    return {"functp.from_pretrained": lambda: functp.from_pretrained(path, mesh)[:2],
            "transformers.from_pretrained + parallelize (keep_module=True)":
                lambda: transformers_then_parallelize(True),
            "transformers.from_pretrained + parallelize (keep_module=False)":
                lambda: transformers_then_parallelize(False)}


def _warm_up(path: str) -> None:
    """Imports the model's code (tens of MiB of modules, the same for every way) and
    builds it once on the meta device, so that the numbers are the weights' alone."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)


def main() -> None:
    """One way of loading (``argv``: the folder, the way's number), in fresh processes."""
    import functp
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    path, way = sys.argv[1], int(sys.argv[2])
    mesh = functp.make_mesh((NPROC,), ("tp",))
    name, load = list(_ways(path, mesh).items())[way]
    _warm_up(path)
    before = _settle()
    _reset_peak()
    apply, params = load()
    peak, after = _status("VmHWM") - before, _settle()
    blocks = sum(v.numel() * v.element_size() for v in params.values())
    mine = {"peak": peak, "resident": after - before, "blocks": blocks,
            "tensor_bytes": _tensor_bytes(apply, params)}
    every = [None] * NPROC
    dist.all_gather_object(every, mine)
    save_and_leave(f"pretrained_memory_{way}", {"way": name, "ranks": every})


def report(path: str, size: int) -> None:
    """Runs each way in fresh processes and prints the table (each rank's worst)."""
    print(f"| way (tp={NPROC}, model {size / 2**20:,.0f} MiB) | peak RSS while loading | "
          f"x model | resident after / blocks | tensor bytes held / blocks |")
    print("|---|---|---|---|---|")
    for way in range(3):
        main_or_launch(main, NPROC, __file__, path, str(way))
        with open(os.path.join(RESULTS, f"pretrained_memory_{way}.json")) as f:
            res = json.load(f)
        r = res["ranks"]
        peak = max(m["peak"] for m in r)
        rss = [m["resident"] / m["blocks"] for m in r]
        held = [m["tensor_bytes"] / m["blocks"] for m in r]
        print(f"| {res['way']} | {peak / 2**20:,.0f} MiB | {peak / size:.3f}x | "
              f"{min(rss):.3f}-{max(rss):.3f} | {min(held):.3f}-{max(held):.3f} |", flush=True)


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        with tempfile.TemporaryDirectory(prefix="functp_pretrained_") as folder:
            report(folder, _write_model(folder))
