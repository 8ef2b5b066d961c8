#!/usr/bin/env python3
"""torch.matmul in bf16 on the shapes of strata's GEMM benchmark, timed with CUDA events.

The shapes come from the benchmark itself (`strata_gemm_bench --shapes`: name m n k ta tb), so
the two always time the same GEMMs: op(A) is A.t() when ta (A stored k x m), op(B) is B.t()
when tb (B stored n x k), as the linear layer's forward (x W^T), dgrad (dy W) and wgrad
(dy^T x) have them. Prints one line a shape, "torch,<name>,<ms>,<tflops>", which
`strata_gemm_bench --torch FILE` reads to print both side by side with the ratio.

    python3 bench/gpu/torch_matmul.py --bench build/bench/gpu/strata_gemm_bench > torch.csv
    build/bench/gpu/strata_gemm_bench --torch torch.csv

Exits 77, saying why, where torch or a CUDA device is missing.
"""
import argparse
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", required=True, help="the strata_gemm_bench executable")
    ap.add_argument("--quick", action="store_true", help="2 timed iterations a shape")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("torch_matmul: skipped: torch is not installed", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("torch_matmul: skipped: torch sees no CUDA device", file=sys.stderr)
        return 77

    out = subprocess.run([args.bench, "--shapes"], check=True, capture_output=True, text=True)
    shapes = []
    for line in out.stdout.splitlines():
        name, m, n, k, ta, tb = line.split()
        shapes.append((name, int(m), int(n), int(k), ta == "1", tb == "1"))

    torch.backends.cuda.matmul.allow_tf32 = False  # irrelevant to bf16; explicit all the same
    dev = torch.device("cuda")
    print(f"# torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name(0)}", file=sys.stderr)
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    for name, m, n, k, ta, tb in shapes:
        a = torch.randn((k, m) if ta else (m, k), device=dev, dtype=torch.bfloat16)
        b = torch.randn((n, k) if tb else (k, n), device=dev, dtype=torch.bfloat16)
        a_op = a.t() if ta else a
        b_op = b.t() if tb else b
        c = torch.empty((m, n), device=dev, dtype=torch.bfloat16)
        for _ in range(2):
            torch.matmul(a_op, b_op, out=c)
        torch.cuda.synchronize()
        flops = 2.0 * m * n * k
        iters = 2 if args.quick else min(200, max(5, int(2e13 / flops)))
        start.record()
        for _ in range(iters):
            torch.matmul(a_op, b_op, out=c)
        stop.record()
        stop.synchronize()
        ms = start.elapsed_time(stop) / iters
        print(f"torch,{name},{ms:.4f},{flops / (ms * 1e-3) / 1e12:.2f}", flush=True)
        del a, b, c
    return 0


if __name__ == "__main__":
    sys.exit(main())
