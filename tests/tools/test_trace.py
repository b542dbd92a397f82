"""Data-movement claims asserted exactly, from the simulator's instruction counts.

`portakern trace` runs one call on opencl:oclgrind with OCLGRIND_INST_COUNTS and reports
per launch the global and local bytes loaded and stored, barriers and FMAs. Here, on small
shapes: the GPU-schedule matmul loads exactly what its tiling formula says; fused attention
stores exactly its output plus its declared workspace (the Sq x Sk scores are never
written); softmax reads its input as many times as its schedule says; and every op's cost
model (compulsory bytes) is checked against the counts. Marked ``simulator``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from portakern.ops import OPS, get_op
from portakern.tools.cli import main
from portakern.tools.trace import FIELDS, make_inputs, trace

pytestmark = pytest.mark.simulator


@pytest.fixture(scope="module")
def sim():  # noqa: ANN201
    try:
        from portakern.backend.oclgrind import OclgrindBackend, simulator_info
    except Exception as exc:
        pytest.skip(f"opencl:oclgrind needs pyopencl: {exc}")
    if simulator_info() is None:
        pytest.skip("opencl:oclgrind: the Oclgrind simulator is not installed")
    return OclgrindBackend.counting()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("m,k,n", [(64, 64, 64), (70, 33, 100), (5, 17, 130)])
def test_matmul_gpu_loads_equal_tiling_formula(sim, m: int, k: int, n: int) -> None:  # noqa: ANN001
    t = trace("matmul", {"a": (m, k), "b": (k, n)}, schedule="gpu", backend=sim)
    c = t.config
    isz = 4
    bm, bn = c["LY"] * c["TM"], c["LX"] * c["TN"] * c["VEC"]
    if c["USE_LOCAL"]:
        # each work-group stages its rows of A and its columns of B once per K slice; the
        # loads are guarded, so edge tiles read only what exists
        loads = isz * (cdiv(n, bn) * m * k + cdiv(m, bm) * k * n)
    else:  # direct path: every item reads TM rows of A and NCOL columns of B per k (clamped)
        items = cdiv(n, bn) * cdiv(m, bm) * c["LX"] * c["LY"]
        loads = isz * items * k * (c["TM"] + c["TN"] * c["VEC"])
    (launch,) = t.launches
    assert launch.global_load_bytes == loads, (t.config, launch)
    assert launch.global_store_bytes == isz * m * n  # C written once
    if (m, k, n) == (64, 64, 64) and c["USE_LOCAL"]:  # one tile: A and B read exactly once
        assert launch.global_load_bytes == isz * (m * k + k * n) == 32768
        assert launch.fma == m * n * k
        assert t.traffic_ratio == 1.0  # the cost model's compulsory bytes, to the byte


ATTENTION_SHAPES = [  # q, k, v, causal, mask
    ((1, 2, 17, 16), (1, 1, 33, 16), (1, 1, 33, 8), True, None),
    ((2, 2, 5, 8), (2, 2, 65, 8), (2, 2, 65, 8), False, (5, 65)),
]


@pytest.mark.parametrize("schedule", ["gpu", "cpu"])
@pytest.mark.parametrize("case", range(len(ATTENTION_SHAPES)))
def test_attention_writes_only_output_and_workspace(sim, schedule: str, case: int) -> None:  # noqa: ANN001
    q, k, v, causal, mask = ATTENTION_SHAPES[case]
    shapes = {"q": q, "k": k, "v": v}
    if mask is not None:
        shapes["mask"] = mask
    t = trace("attention", shapes, schedule=schedule, params={"causal": causal}, backend=sim)
    spec = get_op("attention")
    ins = make_inputs(spec, shapes, "float32")
    bound, params = spec.bind((), {**ins, "causal": causal})
    prob = spec.problem(bound, params)
    ws = spec.workspace(prob, t.config)
    isz = 4
    out_bytes = isz * q[0] * q[1] * q[2] * v[3]
    fused = [la for la in t.launches if la.kernel == "attention"]
    assert len(fused) == 1
    assert fused[0].global_store_bytes == out_bytes  # scores (Sq x Sk) never written
    assert t.totals["global_store_bytes"] == out_bytes + isz * sum(n for n, _ in ws.values())
    for la in t.launches:
        if la.kernel == "attention_pack_kv":  # the copies read K and V exactly once
            assert la.global_load_bytes == isz * (np.prod(k) + np.prod(v))


@pytest.mark.parametrize("schedule", ["gpu", "cpu"])
def test_attention_backward_never_writes_a_score_matrix(sim, schedule: str) -> None:  # noqa: ANN001
    """Issue 28: the fused backward writes dq, dk, dv and its O(S) workspaces (delta; on the
    cpu schedule the packed copies), never an Sq x Sk buffer: every byte the launches store
    is accounted for, and at this shape one score matrix alone would be larger."""
    B, Hq, Hkv, Sq, Sk, D, Dv = 1, 2, 1, 48, 40, 8, 8
    shapes = {"do": (B, Hq, Sq, Dv), "q": (B, Hq, Sq, D), "k": (B, Hkv, Sk, D),
              "v": (B, Hkv, Sk, Dv), "o": (B, Hq, Sq, Dv), "lse": (B, Hq, Sq)}
    t = trace("attention_backward", shapes, schedule=schedule, params={"causal": True},
              backend=sim)
    spec = get_op("attention_backward")
    ins = make_inputs(spec, shapes, "float32")
    bound, params = spec.bind((), {**ins, "causal": True})
    prob = spec.problem(bound, params)
    ws = spec.workspace(prob, t.config)
    isz = 4
    grads = isz * (B * Hq * Sq * D + B * Hkv * Sk * (D + Dv))
    scratch = isz * sum(n for n, _ in ws.values())
    assert t.totals["global_store_bytes"] == grads + scratch, (t.totals, ws)
    assert scratch < isz * B * Hq * Sq * Sk  # O(S) workspace, not a score matrix
    assert isz * Sq * Sk > grads  # one score matrix would outweigh every gradient written


@pytest.mark.parametrize("schedule,dtype,reads_x,reads_y,writes_y", [
    ("gpu", "float32", 2, 0, 1),  # online statistics pass, then the output pass
    ("gpu", "float16", 2, 0, 1),
    ("cpu", "float32", 2, 1, 2),  # STORE_EXP: max pass, exp pass into Y, scale Y in place
    ("cpu", "float16", 2, 0, 1),  # STORE_EXP needs plain storage: the online path
])
def test_softmax_reads_input_as_schedule_says(sim, schedule: str, dtype: str, reads_x: int,  # noqa: ANN001
                                              reads_y: int, writes_y: int) -> None:
    t = trace("softmax", {"x": (3, 100)}, dtype=dtype, schedule=schedule, backend=sim)
    nbytes = 300 * np.dtype(np.float16 if dtype == "float16" else np.float32).itemsize
    (launch,) = t.launches
    assert launch.global_load_bytes == (reads_x + reads_y) * nbytes
    assert launch.global_store_bytes == writes_y * nbytes
    # the cost model counts the input once and the output once
    assert t.compulsory_bytes == 2 * nbytes


@pytest.mark.parametrize("op", list(OPS))
def test_cost_model_bytes_are_a_lower_bound_of_the_counts(sim, op: str) -> None:  # noqa: ANN001
    """Compulsory bytes (inputs once, output once) never exceed what the kernels move, and
    the output part is exactly what they store (workspace aside)."""
    from test_simulator import cases_for

    spec = get_op(op)
    if not spec.source:
        pytest.skip(f"{op}: no C kernel")
    arrays, params = cases_for(op, "float32")[-1]  # the sweep's edge shapes, small
    t = trace(spec, {}, arrays=arrays, params=params, backend=sim)
    assert t.global_bytes >= t.compulsory_bytes > 0, (t.totals, t.compulsory_bytes)
    bound, params = spec.bind((), {**arrays, **params})
    prob = spec.problem(bound, params)
    ws = spec.workspace(prob, t.config) if spec.workspace else {}
    out = 4 * int(np.prod(prob.out_shape))
    stores = t.totals["global_store_bytes"] - 4 * sum(n for n, _ in ws.values())
    assert stores >= out


def test_trace_cli_json(sim, capsys) -> None:  # noqa: ANN001
    assert main(["trace", "attention", "--backend", "opencl:oclgrind", "--shape", "q=1,1,9,8",
                 "--shape", "k=1,1,20,8", "--shape", "v=1,1,20,8", "--param", "causal=true",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [la["kernel"] for la in doc["launches"]] == ["attention"]
    for la in doc["launches"]:
        assert set(FIELDS) <= set(la)
    assert doc["launches"][0]["global_store_bytes"] == 4 * 9 * 8  # only the output
    # q and o (9 rows), and the k and v rows some query attends: causal, top-left, 9 of 20
    assert doc["cost"]["compulsory_bytes"] == 4 * (9 * 16 + 9 * 16)
    assert doc["params"]["causal"] is True
    assert main(["trace", "matmul", "--shape", "a=8,8", "--shape", "b=8,8"]) == 0
    assert "global traffic / compulsory" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--shape", "x=4,x8"], ["--shape", "x=-4,8"],
                                  ["--shape", "x=4,8", "--config", "WG=abc"]])
def test_trace_cli_bad_numbers_are_one_line_errors(argv: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """They ended in a ValueError traceback (exit 1); the CLI promises one line, exit 2."""
    assert main(["trace", "softmax", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "--" in err
