"""Other frameworks' arrays at the public entry points: torch tensors (docs/torch.md).

The layer between ``runtime`` and ``api``: ``api`` asks ``TORCH_CLASSES`` one question per
call, about the class of the first array argument, and sends torch tensors to
``torch_ops.call`` (the ``torch.ops.portakern.*`` custom ops; ``api`` imports it on the first
tensor) before any other work, so that dynamo traces nothing but the custom op. This module
never imports torch nor ``torch_ops``: a process that never passes a tensor never loads them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.errors import InvalidArgumentError
from ..core.spec import KernelSpec
from ..ops import get_op

# The classes of torch tensors: torch.Tensor and nn.Parameter from the moment torch is loaded
# (at this import, or at torch_ops'), and any other Tensor subclass once a call has met it.
# The api's per-call check is ``x.__class__ in TORCH_CLASSES`` (~20 ns); a tensor of a class
# not in it takes the public function's error path, which finds it (``refuse_mixed``) and
# sends the call on. Nothing is added while dynamo traces: torch_ops checks tensors with
# ``isinstance``.
TORCH_CLASSES: set[type] = set()


def _loaded_tensor_class() -> type | None:
    torch = sys.modules.get("torch")  # never imported here: no torch, no tensors
    return getattr(torch, "Tensor", None)


def note_torch_loaded() -> None:
    """Put torch.Tensor and nn.Parameter in TORCH_CLASSES (torch must be imported)."""
    torch = sys.modules["torch"]
    TORCH_CLASSES.update((torch.Tensor, torch.nn.Parameter))


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch.Tensor (of any subclass: Parameter, FakeTensor, ...); its
    class joins TORCH_CLASSES. Not for code dynamo traces (it changes TORCH_CLASSES)."""
    tensor = _loaded_tensor_class()
    if tensor is None or not isinstance(x, tensor):
        return False
    if x.__class__ not in TORCH_CLASSES:
        TORCH_CLASSES.add(x.__class__)
    return True


if _loaded_tensor_class() is not None:
    note_torch_loaded()


def _kind(x: Any) -> str:
    cls = x.__class__
    return f"{cls.__module__}.{cls.__qualname__}"


def refuse_mixed(op: str | KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
                 out: Any = None) -> bool:
    """On a failed call's error path: raise InvalidArgumentError when torch tensors and other
    arrays meet in one call (naming which argument is which); True when every array given is
    a torch tensor (the call may take the torch path), False when none is."""
    if _loaded_tensor_class() is None:
        return False
    try:
        spec = op if isinstance(op, KernelSpec) else get_op(op)
        names: Sequence[str] = spec._operand_names
    except Exception:  # the call's own error says what is wrong with the op
        return False
    given = [(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args)]
    given += [(k, v) for k, v in kwargs.items() if hasattr(v, "shape")]
    if out is not None:
        given.append(("out", out))
    arrays = [(n, a) for n, a in given if a is not None and hasattr(a, "shape")]
    if not arrays:
        return False
    torch_ones = [n for n, a in arrays if is_torch(a)]
    if not torch_ones:
        return False
    others = [(n, a) for n, a in arrays if n not in torch_ones]
    if not others:
        return True
    name = spec.name
    listing = ", ".join(f"{n}: {'torch.Tensor' if n in torch_ones else _kind(a)}"
                        for n, a in arrays)
    raise InvalidArgumentError(
        f"{name}: torch tensors and other arrays in one call ({listing}). Pass every array as "
        f"a torch tensor (torch.from_numpy(x), torch.from_dlpack(x)) to get torch tensors "
        f"back, or none (t.numpy(), cupy.from_dlpack(t)) to get arrays back.") from None


__all__ = ["TORCH_CLASSES", "is_torch", "note_torch_loaded", "refuse_mixed"]
