"""numpy: the float64 oracle. Evaluates each spec's semantics in float64, casts to the output.

Always available; it is what every other backend is tested against, and the reference a user
can fall back to explicitly (never implicitly: portakern does not fall back silently).
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core import dtypes
from ..core.host import host_operand, nbytes_of
from ..core.spec import KernelSpec, Problem, storage_dtype
from .base import ArrayBackend, Availability, DeviceInfo


class NumpyBackend(ArrayBackend):
    name = "numpy"
    oracle = True
    install_hint = "numpy is a hard dependency; reinstall portakern"

    @classmethod
    def _probe(cls) -> Availability:
        dev = DeviceInfo(0, platform.processor() or platform.machine(), "cpu",
                         driver=f"numpy {np.__version__}", fp64=True)
        return Availability(True, versions={"numpy": np.__version__}, devices=[dev])

    @classmethod
    def auto_choices(cls) -> list[tuple[int, str, str]]:
        return [(0, "numpy", "the float64 reference; no faster backend is usable here")]

    @classmethod
    def canonical_device(cls, device: str | None) -> str | None:
        return "0" if device in (None, "", "0", "cpu") else device

    def _open(self, selector: str | None) -> DeviceInfo:
        if selector not in (None, "", "0", "cpu"):
            from ..core.errors import UnknownBackendError

            raise UnknownBackendError(f"numpy has one device (numpy, numpy:0 or numpy:cpu); "
                                      f"got numpy:{selector}.")
        return self.probe().devices[0]

    def supported_dtypes(self) -> tuple[str, ...]:
        return tuple(dtypes.FLOAT_DTYPES)

    def is_native(self, x: object) -> bool:
        return isinstance(x, np.ndarray)

    def as_input(self, name: str, x: Any) -> Any:
        # any layout and byte order is fine here (the oracle converts to float64), but the data
        # must be what validation saw: host_operand refuses shape/dtype stand-ins
        return host_operand(name, x, contiguous=False)

    def device_buffers(self, spec: KernelSpec, prob: Problem, present: Mapping[str, Any],
                       out: Any) -> list[tuple[str, int]]:
        """The oracle's own copies: every operand in float64 (a broadcast view in full), the
        float64 result and its cast to the output dtype."""
        parts = [(f"float64 copy of {k!r}", nbytes_of(v) // max(1, np.dtype(v.dtype).itemsize)
                  * 8) for k, v in present.items()]
        for shape, dt in prob.output_specs.values():  # each output, when there are several
            n = 1
            for d in shape:
                n *= int(d)
            parts.append((f"float64 result {tuple(shape)}", n * 8))
            parts.append((f"output {tuple(shape)} {dt}", n * storage_dtype(dt).itemsize))
        return parts

    def to_native(self, x: np.ndarray) -> np.ndarray:
        return x

    def to_numpy(self, x: Any) -> np.ndarray:
        return x

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, storage_dtype(dtype))

    def execute(self, spec: KernelSpec, prob: Problem, ins: dict[str, Any],
                config: Mapping[str, int] | None) -> np.ndarray:
        if config:  # the oracle has no schedule, but a bad config is an error everywhere
            spec.config("cpu", config, prob)
        args = []
        for op in spec.operands:
            x = ins.get(op.name)
            args.append(None if x is None else
                        (x.astype(bool) if op.kind == "bool" else
                         x.astype(np.int32) if op.kind == "int32" else x.astype(np.float64)))
        with np.errstate(all="ignore"):
            ref = spec.semantics(np, *args, **prob.params)
        if prob.outputs is not None:  # several outputs: the semantics return a tuple
            return tuple(np.asarray(r).astype(storage_dtype(dt))
                         for r, (_, dt) in zip(ref, prob.outputs.values(), strict=True))
        return np.asarray(ref).astype(prob.info.storage)
