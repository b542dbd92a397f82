"""Every documented error: raised before dispatch, with its type and a message naming the
argument, what was expected and what was got. Parametrised over every backend: validation
must not depend on which backend would have run the call."""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.core import dtypes

f32 = np.float32
A = np.ones((4, 5), f32)
B = np.ones((5, 3), f32)
Q = np.ones((1, 4, 6, 8), f32)
KV = np.ones((1, 2, 7, 8), f32)

BAD_CALLS = {
    # matmul
    "matmul rank 1 a": (lambda be: pk.matmul(np.ones(5, f32), B, backend=be),
                        pk.ShapeError, ["a", "rank >= 2", "(5,)"]),
    "matmul rank 0 b": (lambda be: pk.matmul(A, np.float32(1.0), backend=be),
                        pk.ShapeError, ["b", "rank >= 2"]),
    "matmul inner dims": (lambda be: pk.matmul(A, np.ones((4, 3), f32), backend=be),
                          pk.ShapeError, ["inner dimensions", "K=5", "K=4"]),
    "matmul batch dims": (lambda be: pk.matmul(np.ones((2, 4, 5), f32), np.ones((3, 5, 3), f32),
                                               backend=be),
                          pk.ShapeError, ["batch dims", "(2,)", "(3,)"]),
    "matmul mixed dtypes": (lambda be: pk.matmul(A, B.astype(np.float16), backend=be),
                            pk.DTypeError, ["mixed", "a=float32", "b=float16"]),
    "matmul int dtype": (lambda be: pk.matmul(A.astype(np.int32), B.astype(np.int32), backend=be),
                         pk.DTypeError, ["int32", "float32"]),
    "matmul complex dtype": (lambda be: pk.matmul(A.astype(np.complex64), B.astype(np.complex64),
                                                  backend=be),
                             pk.DTypeError, ["complex64"]),
    "matmul list input": (lambda be: pk.matmul([[1.0]], B, backend=be),
                          pk.NotAnArrayError, ["'a'", "list", "np.asarray"]),
    "matmul None input": (lambda be: pk.matmul(None, B, backend=be),
                          pk.NotAnArrayError, ["'a'", "None"]),
    "matmul string input": (lambda be: pk.matmul("ab", B, backend=be),
                            pk.NotAnArrayError, ["'a'", "str"]),
    "matmul unknown kwarg": (lambda be: pk.call("matmul", A, B, transpose=True, backend=be),
                             pk.InvalidArgumentError, ["transpose"]),
    "matmul 32-bit overflow": (lambda be: pk.matmul(
        np.lib.stride_tricks.as_strided(np.ones(1, f32), (70000, 40000), (0, 0)),
        np.ones((40000, 2), f32), backend=be), pk.ShapeError, ["'a'", "32-bit", "2147483647"]),
    # softmax
    "softmax axis out of range": (lambda be: pk.softmax(A, axis=2, backend=be),
                                  pk.InvalidArgumentError, ["axis 2", "rank 2"]),
    "softmax axis not int": (lambda be: pk.softmax(A, axis=1.5, backend=be),
                             pk.InvalidArgumentError, ["axis", "float"]),
    "softmax axis bool": (lambda be: pk.softmax(A, axis=True, backend=be),
                          pk.InvalidArgumentError, ["axis", "bool"]),
    "softmax rank 0": (lambda be: pk.softmax(np.float32(3.0), backend=be),
                       pk.ShapeError, ["x", "rank >= 1"]),
    "softmax int8": (lambda be: pk.softmax(A.astype(np.int8), backend=be),
                     pk.DTypeError, ["int8"]),
    "softmax tuple input": (lambda be: pk.softmax((1.0, 2.0), backend=be),
                            pk.NotAnArrayError, ["'x'", "tuple"]),
    # attention
    "attention q rank 3": (lambda be: pk.attention(Q[0], KV, KV, backend=be),
                           pk.ShapeError, ["q", "rank 4", "(B, Hq, Sq, D)"]),
    "attention D mismatch": (lambda be: pk.attention(Q, KV[..., :4], KV, backend=be),
                             pk.ShapeError, ["head dim", "(4)", "(8)"]),
    "attention GQA mismatch": (lambda be: pk.attention(np.ones((1, 3, 6, 8), f32), KV, KV,
                                                       backend=be),
                               pk.ShapeError, ["Hq=3", "Hkv=2", "multiple"]),
    "attention batch mismatch": (lambda be: pk.attention(Q, np.ones((2, 2, 7, 8), f32),
                                                         np.ones((2, 2, 7, 8), f32), backend=be),
                                 pk.ShapeError, ["batch"]),
    "attention v length mismatch": (lambda be: pk.attention(Q, KV, KV[:, :, :5], backend=be),
                                    pk.ShapeError, ["v", "(B, Hkv, Sk, Dv)"]),
    "attention NaN scale": (lambda be: pk.attention(Q, KV, KV, scale=float("nan"), backend=be),
                            pk.InvalidArgumentError, ["scale", "nan"]),
    "attention inf scale": (lambda be: pk.attention(Q, KV, KV, scale=float("inf"), backend=be),
                            pk.InvalidArgumentError, ["scale", "inf"]),
    "attention negative scale": (lambda be: pk.attention(Q, KV, KV, scale=-1.0, backend=be),
                                 pk.InvalidArgumentError, ["scale", "-1.0", "positive"]),
    "attention zero scale": (lambda be: pk.attention(Q, KV, KV, scale=0, backend=be),
                             pk.InvalidArgumentError, ["scale", "positive"]),
    "attention softcap above 2**126": (lambda be: pk.attention(Q, KV, KV, softcap=3e38,
                                                               backend=be),
                                       pk.InvalidArgumentError, ["softcap", "2**126", "3e+38"]),
    "attention string scale": (lambda be: pk.attention(Q, KV, KV, scale="0.1", backend=be),
                               pk.InvalidArgumentError, ["scale", "str"]),
    "attention float mask": (lambda be: pk.attention(Q, KV, KV, mask=np.ones((6, 7), f32),
                                                     backend=be),
                             pk.DTypeError, ["mask", "boolean", "float32"]),
    "attention mask shape": (lambda be: pk.attention(Q, KV, KV, mask=np.ones((6, 6), bool),
                                                     backend=be),
                             pk.ShapeError, ["mask", "(6, 6)", "(1, 4, 6, 7)"]),
    "attention mask rank 5": (lambda be: pk.attention(Q, KV, KV, mask=np.ones((1, 1, 1, 6, 7),
                                                                              bool), backend=be),
                              pk.ShapeError, ["mask", "rank 5"]),
    "attention causal not bool": (lambda be: pk.attention(Q, KV, KV, causal="yes", backend=be),
                                  pk.InvalidArgumentError, ["causal", "'yes'"]),
    "attention mixed dtypes": (lambda be: pk.attention(Q, KV.astype(np.float16), KV, backend=be),
                               pk.DTypeError, ["mixed", "k=float16"]),
    "attention mask list": (lambda be: pk.attention(Q, KV, KV, mask=[[True]], backend=be),
                            pk.NotAnArrayError, ["'mask'", "list"]),
    "bad tunable": (lambda be: pk.matmul(A, B, backend=be, config={"TM": 3}),
                    pk.InvalidArgumentError, ["TM=3", "domain"]),
    "unknown tunable": (lambda be: pk.matmul(A, B, backend=be, config={"TILE": 4}),
                        pk.InvalidArgumentError, ["TILE"]),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_input_is_rejected(target: str, name: str) -> None:
    fn, err, needles = BAD_CALLS[name]
    if name.endswith("tunable") and target.startswith("jax"):
        pytest.skip(f"{target} has no C-kernel tunables")
    with pytest.raises(err) as info:
        fn(target)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"message lacks {needle!r}: {msg}"
    assert isinstance(info.value, pk.PortakernError)
    assert isinstance(info.value, (ValueError, TypeError))


def test_errors_subclass_builtins() -> None:
    assert issubclass(pk.ShapeError, ValueError)
    assert issubclass(pk.DTypeError, TypeError)
    assert issubclass(pk.NotAnArrayError, TypeError)
    assert issubclass(pk.InvalidArgumentError, ValueError)
    assert issubclass(pk.UnsupportedDTypeError, pk.DTypeError)
    assert issubclass(pk.BackendUnavailable, RuntimeError)
    assert issubclass(pk.CompileError, RuntimeError)
    assert issubclass(pk.DeviceMemoryError, MemoryError)


def test_fp64_on_a_device_without_it_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    from portakern.runtime import selection

    be = selection.get("opencl") if "opencl" in _available() else None
    if be is None:
        pytest.skip("opencl unavailable: " + pk.backends()["opencl"]["reason"])
    monkeypatch.setattr(be.device, "fp64", False)
    with pytest.raises(pk.UnsupportedDTypeError) as info:
        pk.matmul(A.astype(np.float64), B.astype(np.float64), backend=be)
    assert "float64" in str(info.value) and "fp64" in str(info.value)


def test_compile_error_shows_numbered_source_and_log() -> None:
    if "opencl" not in _available():
        pytest.skip("opencl unavailable: " + pk.backends()["opencl"]["reason"])
    spec = pk.ops.get_op("softmax").replace(source="PK_KERNEL void softmax() { oops; }")
    pk.register_op(spec.replace(name="softmax_broken"), replace=True)
    try:
        with pytest.raises(pk.CompileError) as info:
            pk.call("softmax_broken", A, backend="opencl")
    finally:
        pk.ops.OPS.pop("softmax_broken", None)
    msg = str(info.value)
    assert "oops" in msg and "rendered source" in msg and "compiler log" in msg
    assert any(line.strip().startswith("1 |") for line in msg.splitlines())
    assert "device:" in msg and "options:" in msg


def test_bf16_is_accepted_on_numpy_as_ml_dtypes() -> None:
    a = np.ones((2, 2), dtypes.bfloat16)
    assert pk.matmul(a, a, backend="numpy").dtype == dtypes.bfloat16


def _available() -> set[str]:
    return {k for k, v in pk.backends().items() if v["available"]}


def test_memoised_validation_tells_bool_from_int(target: str) -> None:
    """True == 1 in Python; a valid axis=1 call must not let axis=True through afterwards."""
    pk.softmax(A, axis=1, backend=target)
    with pytest.raises(pk.InvalidArgumentError, match="bool"):
        pk.softmax(A, axis=True, backend=target)
    pk.attention(Q, KV, KV, causal=False, backend=target)
    with pytest.raises(pk.InvalidArgumentError, match="causal"):
        pk.attention(Q, KV, KV, causal=0, backend=target)
