"""The portability-gap benchmark (docs/bench.md).

timing (samples, repetition, time box) · metrics (efficiency, PP, roofline) · probes(.c)
(copy bandwidth and FMA peak through each backend) · peers (numpy/BLAS in its own process,
XLA, CLBlast, cuBLAS, cuDNN) · suites (cases and inputs) · runner (`portakern bench`) ·
report (tables, `portakern report`) · plots (PNG) · environment (what the run ran on) · cli.
"""
