"""``import portakern.torch``: every portakern op as a torch custom op, ``torch.ops.portakern.*``
(docs/torch.md). The implementation is portakern/interop/torch_ops.py; importing this module
registers the ops (the first call of a public op on a tensor does too)."""

from __future__ import annotations

from .interop.torch_ops import NAMESPACE, register, registered

__all__ = ["NAMESPACE", "register", "registered"]
