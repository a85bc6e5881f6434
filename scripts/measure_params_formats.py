"""Params-cache formats, A/B: orbax restore vs safetensors (mmap or copy) vs one .npy per leaf.

    .venv/bin/python scripts/measure_params_formats.py prepare ORBAX_ENTRY OUT_DIR
    .venv/bin/python scripts/measure_params_formats.py ab ORBAX_ENTRY OUT_DIR [--repeat 3]

`prepare` restores an existing orbax params-cache entry (the pre-issue-12 format:
`<entry>/params/` + `meta.json`) and writes the same tree as OUT_DIR/params.safetensors
and OUT_DIR/npy/<leaf>.npy. `ab` then runs each format in a fresh subprocess,
interleaved, `--repeat` rounds (page cache warm for all: the "cached restart" case),
and prints one JSON line per run: seconds to import the reader, to load the host
tree, to put it on the device in the engine layout (`prepare_params`, unrolled,
as the runner does), the process RSS after the host tree is dropped
(gc + malloc_trim, as `cli.release_host_memory`), and the peak RSS (VmHWM).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from jaxserve.checkpoint.cache import _flatten as _flat, _unflatten as _unflat


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024
    return -1


def prepare(entry: Path, out: Path) -> None:
    import numpy as np
    import orbax.checkpoint as ocp
    from safetensors import TensorSpec, serialize_file

    with ocp.StandardCheckpointer() as ck:
        tree = ck.restore((entry / "params").resolve())
    flat = {k: np.ascontiguousarray(v) for k, v in _flat(tree).items()}
    out.mkdir(parents=True, exist_ok=True)
    serialize_file({k: TensorSpec(dtype=v.dtype.name, shape=list(v.shape), data_ptr=v.ctypes.data,
                                  data_len=v.nbytes) for k, v in flat.items()},
                   str(out / "params.safetensors"))
    (out / "npy").mkdir(exist_ok=True)
    for k, v in flat.items():
        np.save(out / "npy" / f"{k}.npy", v)
    (out / "meta.json").write_text((entry / "meta.json").read_text())


def load(fmt: str, entry: Path, out: Path) -> None:
    t0 = time.perf_counter()
    import numpy as np

    if fmt == "orbax":
        import orbax.checkpoint as ocp
    else:
        import struct

    import jax

    from jaxserve.checkpoint.cache import _config_from_dict
    from jaxserve.model.llama import prepare_params

    jax.devices()
    t1 = time.perf_counter()
    flat = None
    if fmt == "orbax":
        with ocp.StandardCheckpointer() as ck:
            tree = ck.restore((entry / "params").resolve())
    elif fmt.startswith("st_"):
        path = out / "params.safetensors"
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
        header = json.loads(bytes(buf[8:8 + hlen]))
        header.pop("__metadata__", None)
        base = 8 + hlen
        dts = {"F32": np.float32, "BF16": jax.numpy.bfloat16}
        flat = {}
        for k, info in header.items():
            s, e = info["data_offsets"]
            a = buf[base + s:base + e].view(dts[info["dtype"]]).reshape(info["shape"])
            flat[k] = a.copy() if fmt == "st_copy" else a
        del buf, a
        tree = _unflat(flat)
    else:
        flat = {p.stem: np.load(p, mmap_mode="r") for p in sorted((out / "npy").glob("*.npy"))}
        tree = _unflat(flat)
    t2 = time.perf_counter()
    cfg = _config_from_dict(json.loads((out / "meta.json").read_text())["config"])
    dev = prepare_params(cfg, tree, unroll_layers=True)
    jax.block_until_ready(dev)
    t3 = time.perf_counter()
    del tree, flat
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    print(json.dumps({"fmt": fmt, "import_init_s": round(t1 - t0, 3), "load_s": round(t2 - t1, 3),
                      "device_s": round(t3 - t2, 3), "load_plus_device_s": round(t3 - t1, 3),
                      "rss_after_mib": _status("VmRSS"), "peak_rss_mib": _status("VmHWM")}),
          flush=True)


def main() -> None:
    cmd, entry, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if cmd == "prepare":
        prepare(entry, out)
    elif cmd == "load":
        load(sys.argv[4], entry, out)
    else:
        repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 3
        up = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
        print("# start", up(), flush=True)
        for _ in range(repeat):
            for fmt in ("orbax", "st_mmap", "st_copy", "npy_mmap"):
                subprocess.run([sys.executable, __file__, "load", str(entry), str(out), fmt], check=True)
        print("# end", up(), flush=True)


if __name__ == "__main__":
    main()
