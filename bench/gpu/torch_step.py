#!/usr/bin/env python3
"""PyTorch eager beside strata's step benchmark (bench/gpu/step_bench.cu): the same GPT-2 shapes.

GPT-2 124M (vocab 50304, d 768, 12 layers, 12 heads) and 350M (d 1024, 24 layers, 16 heads),
T 1024, B 16, untied head (as strata's device trainer), eager mode with
F.scaled_dot_product_attention(is_causal=True), bf16 autocast over f32 weights, fused AdamW
(lr 6e-4, weight decay 0.1), clipping at 1.0, one loss.item() a step. A few warm-up steps, then
each timed step between two CUDA events; the median gives ms/step, tokens/s, TFLOP/s and MFU with
llm.c's flops per token 6N + 6LTd against the spec peak (989 TFLOP/s dense bf16) and against an
8192^3 bf16 torch.matmul measured in the same run. Lines start with "torch " and otherwise read
as step_bench's.

    python3 bench/gpu/torch_step.py [--model 124m|350m|both] [--steps N] [--warmup N] [--batch B]

Exits 77, saying why, where torch or a CUDA device is missing.
"""
import argparse
import math
import statistics
import sys

SPEC_PEAK = 989.0  # TFLOP/s, dense bf16, H100/H200 SXM
SHAPES = {
    "124m": dict(vocab=50304, d=768, layers=12, heads=12),
    "350m": dict(vocab=50304, d=1024, layers=24, heads=16),
}


def build(torch, vocab, d, layers, heads, seq):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.fc_proj = nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))

    return GPT()


def gemm_peak(torch):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(10):
        start.record()
        torch.matmul(a, b, out=c)
        stop.record()
        stop.synchronize()
        ms.append(start.elapsed_time(stop))
    per = statistics.median(ms)
    tflops = 2.0 * n**3 / (per * 1e-3) / 1e12
    print(f"torch gemm peak: bf16 {n}^3 through torch.matmul, {per:.3f} ms, {tflops:.1f} TFLOP/s "
          f"({100 * tflops / SPEC_PEAK:.1f}% of the spec {SPEC_PEAK:.0f})")
    del a, b, c
    return tflops


def run_model(torch, name, shape, args, peak):
    seq, batch = 1024, args.batch
    print(f"\ntorch == GPT-2 {name}: vocab {shape['vocab']}, d {shape['d']}, {shape['layers']} "
          f"layers, {shape['heads']} heads, T {seq}, B {batch}, bf16 autocast + f32 weights, "
          f"fused AdamW, eager + SDPA")
    torch.manual_seed(1234)
    model = build(torch, seq=seq, **shape).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, shape["vocab"], (batch, seq + 1), generator=g)
    idx, targets = tokens[:, :-1].cuda(), tokens[:, 1:].contiguous().cuda()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step() for _ in range(args.warmup)]
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(args.steps):
        start.record()
        losses.append(step())
        stop.record()
        stop.synchronize()
        ms.append(start.elapsed_time(stop))
    per = statistics.median(ms)
    fpt = 6.0 * n_params + 6.0 * shape["layers"] * seq * shape["d"]
    tps = batch * seq / (per * 1e-3)
    tflops = fpt * tps / 1e12
    mfu = tflops / SPEC_PEAK
    ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    print(f"torch parameters N = {n_params}; flops per token 6N + 6LTd = {fpt:.4g}")
    print(f"torch step {name}: median of {len(ms)} steps {per:.2f} ms/step (min {min(ms):.2f}, "
          f"max {max(ms):.2f}), {tps:.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU {100 * mfu:.1f}% of "
          f"spec {SPEC_PEAK:.0f}, {100 * tflops / peak:.1f}% of the measured GEMM peak {peak:.1f}")
    print(f"torch loss {name}: first {losses[0]:.4f}, last {losses[-1]:.4f} ({len(losses)} steps "
          f"on a fixed batch): {'finite and falling' if ok else 'NOT finite and falling'}")
    del model, opt
    torch.cuda.empty_cache()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["124m", "350m", "both"], default="both")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_step: skipped: torch is not installed")
        return 77
    if not torch.cuda.is_available():
        print("torch_step: skipped: torch sees no CUDA device")
        return 77
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"torch_step: torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name(0)}")
    peak = gemm_peak(torch)
    ok = True
    for name in (["124m", "350m"] if args.model == "both" else [args.model]):
        try:
            ok = run_model(torch, name, SHAPES[name], args, peak) and ok
        except Exception as e:  # an out-of-memory shape reports and lets the other run
            print(f"torch FAIL {name}: {e}")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
