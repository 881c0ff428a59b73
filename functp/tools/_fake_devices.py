"""Devices in a dry run: a program written for ``cuda`` estimated on a torch without it.

``functp.estimate`` runs the program on fake tensors, but torch's autograd asks the
device's runtime for a stream whenever it records a leaf (``AccumulateGrad``): a
fake ``cuda`` parameter with ``requires_grad`` aborts a CPU-only torch (a C++
``terminate``, not an exception). So a device this torch cannot run is *traced as the
CPU*: :class:`Devices` (a ``TorchFunctionMode`` under the program's own
``torch.device(...)`` context) turns every ``device=`` it is asked for, ``.to(device)``
and ``.cuda()`` into the CPU, and records the device the program asked for. What
depends on the device follows that record, not the tensors:

- the memory of ``scaled_dot_product_attention``: the CPU's fused kernel holds what
  CUDA's flash and memory-efficient kernels hold (the output and a float32
  log-sum-exp per query row), so a ``cuda`` program's SDPA is estimated as flash
  (bf16/fp16 inputs without an explicit mask) or memory-efficient (otherwise), the
  choice only named (the memory counted is the CPU kernel's; not checked against
  every case where the two runtimes pick differently);
- the printout names the device assumed and the SDPA kernel counted.

Values a program reads on the host are unaffected (they are computed on the CPU).
A device this torch can run is traced as itself.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..runtime._errors import ShardingError

__all__ = ["Devices", "runnable", "refused"]

_SDPA = torch.nn.functional.scaled_dot_product_attention
_CPU = torch.device("cpu")
# Tensor methods that take a device positionally
_MOVES = {torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros,
          torch.Tensor.new_ones, torch.Tensor.new_full, torch.Tensor.new_tensor}


def runnable(device: torch.device) -> bool:
    """Whether this torch has a runtime for ``device`` (its fakes can be traced as
    themselves)."""
    if device.type in ("cpu", "meta"):
        return True
    mod = getattr(torch, device.type, None)
    available = getattr(mod, "is_available", None)
    return bool(available()) if callable(available) else False


def _as_device(x: Any) -> torch.device | None:
    if isinstance(x, torch.device):
        return x
    if isinstance(x, str):
        try:
            return torch.device(x)
        except RuntimeError:
            return None
    return None


class Devices(TorchFunctionMode):
    """Traces devices this torch cannot run as the CPU, recording each one asked for
    (``asked``) and the SDPA kernels counted (``sdpa``: {kernel: calls})."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: dict[str, int] = {}
        self.sdpa: dict[str, int] = {}

    def _map(self, x: Any) -> Any:
        d = _as_device(x)
        if d is None or runnable(d):
            return x
        self.asked[d.type] = self.asked.get(d.type, 0) + 1
        return _CPU

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = self._map(kwargs["device"])
        if func in _MOVES:
            args = (args[0],) + tuple(self._map(a) for a in args[1:])
        elif func is torch.Tensor.cuda:
            self.asked["cuda"] = self.asked.get("cuda", 0) + 1
            if not runnable(torch.device("cuda")):
                return args[0]
        elif func is _SDPA and self.asked:
            self._count_sdpa(args, kwargs)
        return func(*args, **kwargs)

    def _count_sdpa(self, args, kwargs) -> None:
        q = args[0]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        if q.dtype == torch.float64 or (mask is not None and dropout):
            kernel = "math"
        elif q.dtype in (torch.bfloat16, torch.float16) and mask is None \
                and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
            kernel = "flash"
        else:
            kernel = "memory-efficient"
        self.sdpa[kernel] = self.sdpa.get(kernel, 0) + 1

    def assumed(self) -> str | None:
        """One line for the printout: the devices traced as the CPU, and the kernels."""
        if not self.asked:
            return None
        kernels = ", ".join(f"{k} x{n}" for k, n in self.sdpa.items())
        return (f"{'/'.join(sorted(self.asked))} program traced on CPU fakes (this torch "
                f"has no {'/'.join(sorted(self.asked))}); scaled_dot_product_attention "
                f"as {kernels or 'not called'}")


def refused(e: BaseException, rank: int) -> ShardingError:
    """The error for ``module.to(dtype or device)`` of a module built in the program:
    torch swaps fake parameters for converted ones, and refuses when its fake-tensor
    cache holds a weak reference to one (every fake parameter)."""
    return ShardingError(
        f"functp.estimate (rank {rank}): {e} — a module built inside the estimated "
        f"program cannot be converted with .to(dtype)/.to(device)/.double()/.half() "
        f"under fake tensors (torch cannot swap fake parameters). Build it in that "
        f"dtype and on that device instead: torch.set_default_dtype(torch.bfloat16) "
        f"and `with torch.device('cuda'):` around its construction (transformers: "
        f"Model(config) inside them, or from_pretrained(..., dtype=torch.bfloat16)), "
        f"and restore the default dtype after")
