#!/usr/bin/env python3
"""strata's safetensors files against the reference library (Hugging Face's safetensors).

(a) strata_safetensors_tool writes its fixed tensors; safetensors reads them (numpy's
    load_file, and safe_open plus deserialize for BF16, which numpy has no type for) and every
    value is compared bit for bit with the same formulas computed here.
(b) safetensors writes the same tensors (numpy's save_file, and serialize_file with BF16);
    strata_safetensors_tool checks them.

The formulas are listed in safetensors_tool.cpp. Run by ctest (checkpoint.safetensors.python):
    python3 safetensors_interop.py --tool PATH/strata_safetensors_tool
Fails (exit 1) when python3 cannot import safetensors or numpy: scripts/setup.sh installs them.
"""

import argparse
import json
import os
import struct
import subprocess
import sys

try:
    import numpy as np
    import safetensors
    import safetensors.numpy as stnp
except ImportError as e:
    print(f"safetensors_interop: cannot import {e.name} ({e}); install the Python packages "
          "with scripts/setup.sh (python3 -m pip install safetensors numpy)", file=sys.stderr)
    sys.exit(1)

NAMES = ["f64", "f32", "f16", "bf16", "i64", "i32", "u8", "scalar", "empty"]
WITHOUT_BF16 = [n for n in NAMES if n != "bf16"]
METADATA = {"producer": "strata interop", "seed": "24"}


def fixed():
    """name -> (safetensors dtype, numpy array); BF16 as its uint16 bit patterns."""
    def idx(*shape):
        return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)

    i = idx(4, 4)
    bf16 = ((i - 8).astype(np.float32) / np.float32(3)).view(np.uint32) >> 16
    return {
        "f64": ("F64", idx(3, 4).astype(np.float64) * 0.5 - 2.75),
        "f32": ("F32", idx(2, 3, 4).astype(np.float32) * np.float32(0.25) - np.float32(3)),
        "f16": ("F16", ((idx(5, 3) - 7) * 0.125).astype(np.float16)),
        "bf16": ("BF16", bf16.astype(np.uint16)),
        "i64": ("I64", (idx(6) * idx(6) - 7) * (1 << 40) + idx(6)),
        "i32": ("I32", (idx(7) ** 3 - 100).astype(np.int32)),
        "u8": ("U8", ((idx(9) * 37 + 11) % 256).astype(np.uint8)),
        "scalar": ("F32", np.array(-1.75, dtype=np.float32)),
        "empty": ("F32", np.zeros((2, 0), dtype=np.float32)),
    }


FIXED = fixed()
failures = []


def fail(what):
    print(f"safetensors_interop: {what}", file=sys.stderr)
    failures.append(what)


def compare(where, name, dtype, shape, raw):
    """Compares a tensor's dtype, shape and little-endian bytes with the fixed data."""
    want_dtype, want = FIXED[name]
    if dtype != want_dtype:
        fail(f"{where}: tensor '{name}' is {dtype}, not {want_dtype}")
    if list(shape) != list(want.shape):
        fail(f"{where}: tensor '{name}' has shape {list(shape)}, not {list(want.shape)}")
    want_raw = want.astype(want.dtype.newbyteorder("<")).tobytes()
    if bytes(raw) != want_raw:
        fail(f"{where}: tensor '{name}' differs from the fixed data bit for bit")


def run_tool(tool, *args):
    r = subprocess.run([tool, *args], capture_output=True, text=True)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    return r.returncode


def raw_header(path):
    """The header's tensor names in file order (duplicates refused) and where the data starts."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            fail(f"{path}: the header repeats a key: {keys}")
        return dict(pairs)

    header = json.loads(blob[8:8 + n].decode("utf-8"), object_pairs_hook=no_duplicates)
    return [k for k in header if k != "__metadata__"], 8 + n, blob


def strata_writes(tool):
    """(a): strata writes, safetensors reads."""
    path = "interop_strata.safetensors"
    if run_tool(tool, "write", path) != 0:
        fail("strata_safetensors_tool write failed")
        return
    names, data_start, blob = raw_header(path)
    if names != NAMES:
        fail(f"{path}: the header lists {names}, not the order written {NAMES}")
    if data_start % 8 != 0:
        fail(f"{path}: the data starts at byte {data_start}, not 8-byte aligned")

    # safe_open reads every dtype numpy has; BF16 comes as raw bytes from deserialize.
    with safetensors.safe_open(path, framework="np") as f:
        if sorted(f.keys()) != sorted(NAMES):
            fail(f"{path}: safe_open finds {sorted(f.keys())}")
        if f.metadata() != METADATA:
            fail(f"{path}: safe_open finds the metadata {f.metadata()}, not {METADATA}")
        for name in WITHOUT_BF16:
            t = f.get_tensor(name)
            compare(f"{path} (safe_open)", name, FIXED[name][0], t.shape, t.tobytes())
    for name, t in safetensors.deserialize(blob):
        if name == "bf16":
            compare(f"{path} (deserialize)", name, t["dtype"], t["shape"], t["data"])

    # numpy's load_file, on a file without BF16 (numpy has no bfloat16 to load it as).
    path = "interop_strata_numpy.safetensors"
    if run_tool(tool, "write", path, *WITHOUT_BF16) != 0:
        fail("strata_safetensors_tool write (without bf16) failed")
        return
    loaded = stnp.load_file(path)
    if sorted(loaded) != sorted(WITHOUT_BF16):
        fail(f"{path}: load_file finds {sorted(loaded)}")
    for name in WITHOUT_BF16:
        if name in loaded:
            t = loaded[name]
            compare(f"{path} (load_file)", name, FIXED[name][0], t.shape, t.tobytes())


def python_writes(tool):
    """(b): safetensors writes, strata reads."""
    path = "interop_python_numpy.safetensors"
    stnp.save_file({n: FIXED[n][1] for n in WITHOUT_BF16}, path, metadata=METADATA)
    if run_tool(tool, "check", path, *WITHOUT_BF16) != 0:
        fail(f"strata_safetensors_tool check {path} found differences (above)")

    # BF16 through the library's raw serializer: the uint16 bit patterns as bfloat16.
    path = "interop_python_bf16.safetensors"
    arrays = {n: np.array(FIXED[n][1], order="C") for n in NAMES}  # (keeps 0-d arrays 0-d)
    if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8
        specs = {n: safetensors.TensorSpec(dtype="bfloat16" if n == "bf16" else a.dtype.name,
                                           shape=list(a.shape), data_ptr=a.ctypes.data,
                                           data_len=a.nbytes)
                 for n, a in arrays.items()}
    else:
        specs = {n: {"dtype": FIXED[n][0], "shape": list(a.shape), "data": a.tobytes()}
                 for n, a in arrays.items()}
    safetensors.serialize_file(specs, path, metadata=METADATA)
    if run_tool(tool, "check", path) != 0:
        fail(f"strata_safetensors_tool check {path} found differences (above)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", required=True, help="the strata_safetensors_tool executable")
    tool = os.path.abspath(parser.parse_args().tool)
    print(f"safetensors {safetensors.__version__}, numpy {np.__version__}")
    strata_writes(tool)
    python_writes(tool)
    if failures:
        print(f"safetensors_interop: {len(failures)} differences", file=sys.stderr)
        return 1
    print("safetensors_interop: strata's files read in safetensors and safetensors' files read "
          "in strata, bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
