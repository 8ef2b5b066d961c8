#!/usr/bin/env python3
"""strata's GPT against a numpy GPT-2 (Hugging Face's layout and transformers' GPT2Model forward).

(a) GPT-2 files of random weights (vocab 50, n_positions 16, d 32, 2 layers, 4 heads) in HF's
    layout: one F32 model.safetensors in GPT2Model's names with the attention buffers, and an
    index over two F16 files in GPT2LMHeadModel's names ("transformer." and lm_head.weight).
    numpy computes the logits of fixed tokens (GELU "gelu_new", the tanh form; layer norm eps
    1e-5; causal softmax attention; the head tied to wte) in float64; strata_gpt2_tool imports
    each file into gpt_model and compares its f32 logits with them.
(b) strata_gpt2_tool exports its randomly initialised GPT (after three AdamW steps, so biases
    and norms are off their init); safetensors.numpy loads the file, numpy computes the logits
    and compares them with the tool's.

Passes when every max |difference| is <= 1e-4 of the logits' scale (max |logit|). Run by ctest
(checkpoint.gpt2.python):
    python3 gpt2_interop.py --tool PATH/strata_gpt2_tool
Fails (exit 1) when python3 cannot import safetensors or numpy: scripts/setup.sh installs them.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

try:
    import numpy as np
    import safetensors.numpy as stnp
except ImportError as e:
    print(f"gpt2_interop: cannot import {e.name} ({e}); install the Python packages with "
          "scripts/setup.sh (python3 -m pip install safetensors numpy)", file=sys.stderr)
    sys.exit(1)

VOCAB, POSITIONS, D, LAYERS, HEADS = 50, 16, 32, 2, 4
TOLERANCE = 1e-4
failures = []


def fail(what):
    print(f"gpt2_interop: {what}", file=sys.stderr)
    failures.append(what)


def gpt2_names(layers):
    names = ["wte.weight", "wpe.weight"]
    for i in range(layers):
        names += [f"h.{i}.{n}" for n in (
            "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
            "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
            "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")]
    return names + ["ln_f.weight", "ln_f.bias"]


def random_gpt2(rng):
    """GPT2Model's parameters in HF's layout (Conv1D weights [in, out]), float32."""
    def normal(std, *shape):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {"wte.weight": normal(0.5, VOCAB, D), "wpe.weight": normal(0.3, POSITIONS, D)}
    for i in range(LAYERS):
        h = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            w[h + ln + ".weight"] = 1 + normal(0.1, D)
            w[h + ln + ".bias"] = normal(0.1, D)
        w[h + "attn.c_attn.weight"] = normal(0.2, D, 3 * D)
        w[h + "attn.c_attn.bias"] = normal(0.1, 3 * D)
        w[h + "attn.c_proj.weight"] = normal(0.2, D, D)
        w[h + "attn.c_proj.bias"] = normal(0.1, D)
        w[h + "mlp.c_fc.weight"] = normal(0.2, D, 4 * D)
        w[h + "mlp.c_fc.bias"] = normal(0.1, 4 * D)
        w[h + "mlp.c_proj.weight"] = normal(0.1, 4 * D, D)
        w[h + "mlp.c_proj.bias"] = normal(0.1, D)
    w["ln_f.weight"] = 1 + normal(0.1, D)
    w["ln_f.bias"] = normal(0.1, D)
    return w


def gelu_new(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def forward(w, tokens, heads):
    """GPT2LMHeadModel's logits [sequences, seq, vocab] of tokens [sequences, seq], in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    s, t = tokens.shape
    d = w["wte.weight"].shape[1]
    hd = d // heads
    layers = sum(1 for k in w if k.endswith(".ln_1.weight"))
    x = w["wte.weight"][tokens] + w["wpe.weight"][:t]
    causal = np.tril(np.ones((t, t), dtype=bool))
    for i in range(layers):
        p = f"h.{i}."
        a = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
        qkv = a @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (m.reshape(s, t, heads, hd).transpose(0, 2, 1, 3) for m in np.split(qkv, 3, -1))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        y = (probs @ v).transpose(0, 2, 1, 3).reshape(s, t, d)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        m = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        m = gelu_new(m @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
    return x @ w["wte.weight"].T


def compare(what, got, want):
    """Max |difference| against the scale; records a failure above the tolerance."""
    got = np.asarray(got, dtype=np.float64).reshape(want.shape)
    diff = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    rel = diff / scale if scale > 0 else float("inf")
    print(f"gpt2_interop: {what}: max |strata - numpy| {diff:.3g}, max |numpy| {scale:.3g}, "
          f"relative {rel:.3g} (limit {TOLERANCE:g})")
    if not rel <= TOLERANCE:
        fail(f"{what}: logits differ by {rel:.3g} of their scale, over {TOLERANCE:g}")


def run_tool(tool, *args):
    r = subprocess.run([tool, *args], capture_output=True, text=True)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    return r.returncode


def strata_imports(tool, rng):
    """(a): numpy's GPT-2 files imported by strata, the logits compared both ways."""
    w = random_gpt2(rng)
    tokens = rng.integers(0, VOCAB, size=(3, 12)).astype(np.int32)  # shorter than n_positions

    # One F32 file in GPT2Model's names, with the causal-mask buffers older files carry.
    single = "gpt2_random"
    shutil.rmtree(single, ignore_errors=True)
    os.makedirs(single)
    f = dict(w)
    for i in range(LAYERS):
        f[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, POSITIONS, POSITIONS), np.float32))
        f[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    stnp.save_file(f, os.path.join(single, "model.safetensors"), metadata={"format": "pt"})

    # Two F16 files in GPT2LMHeadModel's names and the index that names them.
    sharded = "gpt2_random_sharded"
    shutil.rmtree(sharded, ignore_errors=True)
    os.makedirs(sharded)
    h16 = {k: v.astype(np.float16) for k, v in w.items()}
    names = gpt2_names(LAYERS)
    parts = [names[:14], names[14:]]
    weight_map = {}
    for n, part in enumerate(parts):
        file = f"model-{n + 1:05d}-of-{len(parts):05d}.safetensors"
        tensors = {"transformer." + k: h16[k] for k in part}
        if n == len(parts) - 1:
            tensors["lm_head.weight"] = h16["wte.weight"]
        stnp.save_file(tensors, os.path.join(sharded, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
    total = sum(v.nbytes for v in h16.values()) + h16["wte.weight"].nbytes
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as out:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, out, indent=2)

    for what, path, weights in (("one F32 file (GPT2Model names, attention buffers)", single, w),
                                ("an index over two F16 files (GPT2LMHeadModel names, lm_head)",
                                 sharded, {k: v.astype(np.float32) for k, v in h16.items()})):
        want = forward(weights, tokens, HEADS)
        reference = path + "_reference.safetensors"
        stnp.save_file({"tokens": tokens, "logits": want.astype(np.float32)}, reference)
        out = path + "_strata_logits.safetensors"
        if run_tool(tool, "import", path, str(HEADS), reference, out) != 0:
            fail(f"strata_gpt2_tool import {path} failed")
            continue
        compare(f"import of {what}", stnp.load_file(out)["logits"], want)


def strata_exports(tool, rng):
    """(b): strata's GPT exported, loaded by safetensors.numpy, its logits computed by numpy."""
    out_dir = "gpt2_strata_export"
    shutil.rmtree(out_dir, ignore_errors=True)
    tokens = rng.integers(0, VOCAB, size=(2, POSITIONS)).astype(np.int32)
    stnp.save_file({"tokens": tokens}, "gpt2_export_tokens.safetensors")
    logits_file = "gpt2_export_strata_logits.safetensors"
    if run_tool(tool, "export", out_dir, "gpt2_export_tokens.safetensors", logits_file) != 0:
        fail("strata_gpt2_tool export failed")
        return
    model = os.path.join(out_dir, "model.safetensors")
    w = stnp.load_file(model)
    if sorted(w) != sorted(gpt2_names(LAYERS)):
        fail(f"{model}: holds {sorted(w)}, not GPT-2's names {sorted(gpt2_names(LAYERS))}")
        return
    shapes = {"wte.weight": (VOCAB, D), "wpe.weight": (POSITIONS, D),
              "h.0.attn.c_attn.weight": (D, 3 * D), "h.0.attn.c_attn.bias": (3 * D,),
              "h.1.attn.c_proj.weight": (D, D), "h.1.mlp.c_fc.weight": (D, 4 * D),
              "h.1.mlp.c_proj.weight": (4 * D, D), "ln_f.weight": (D,)}
    for name, shape in shapes.items():
        if w[name].shape != shape or w[name].dtype != np.float32:
            fail(f"{model}: '{name}' is {w[name].dtype} {w[name].shape}, not float32 {shape}")
    from safetensors import safe_open
    with safe_open(model, framework="np") as f:
        if f.metadata() != {"format": "pt"}:
            fail(f"{model}: metadata {f.metadata()}, not {{'format': 'pt'}}")
    with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    if index.get("weight_map") != {k: "model.safetensors" for k in gpt2_names(LAYERS)}:
        fail(f"{out_dir}: the index's weight_map is not every tensor in model.safetensors")
    if index.get("metadata", {}).get("total_size") != sum(v.nbytes for v in w.values()):
        fail(f"{out_dir}: the index's total_size is not the tensors' bytes")
    if not np.any(w["h.0.attn.c_attn.bias"]):
        fail(f"{model}: the biases are all zero: the export's bias map is not exercised")
    compare("export of strata's GPT (3 AdamW steps from its init)",
            stnp.load_file(logits_file)["logits"], forward(w, tokens, HEADS))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", required=True, help="path of strata_gpt2_tool")
    args = parser.parse_args()
    rng = np.random.default_rng(24)
    strata_imports(args.tool, rng)
    strata_exports(args.tool, rng)
    if failures:
        print(f"gpt2_interop: {len(failures)} failure(s)", file=sys.stderr)
        return 1
    print("gpt2_interop: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
