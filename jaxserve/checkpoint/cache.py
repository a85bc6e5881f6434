"""Cache of converted parameter trees, keyed by the source's content hash and dtype.

Layout: `<cache_dir>/<sha256(source)[:16]>-<dtype>-npy1/` holds one `.npy` file per
leaf of the converted NumPy tree (`embed.npy`, `layers.wq.npy`, ...; NumPy's own
format, whose header pads the data to a 64-byte boundary) and `meta.json` (the
ModelConfig, the serialized Tokenizer and each leaf's dtype and shape), so a hit
needs neither the GGUF metadata parse (~4 s for SmolLM2's 49k-token vocabulary in
`GGUFReader`) nor any conversion. A hit memory-maps the leaves copy-on-write
(`np.load(mmap_mode="c")`): loading reads nothing, and on CPU `jax.device_put`
aliases a 64-byte-aligned host array instead of copying it, so the engine's
weights are the page cache's pages (as llama.cpp's mmap of its GGUF). Measured
against the orbax checkpoint this cache used before (notes/params_startup.md):
restore + device_put 0.04-0.06 s vs 1.8-4.0 s, RSS after load 222 vs 777 MiB,
`import orbax` (0.3-0.5 s) gone; the entry is uncompressed (538 MB vs orbax's
335 MB for SmolLM2 fp32). Copy-on-write keeps the file immutable: a write to
a leaf (or a donated buffer) copies the page, never reaches the file.

A GGUF's key hashes the whole file; an HF dir's key hashes config/tokenizer files
and every *.safetensors / index file (name + content). Hashing 100 MB takes ~0.3 s,
so digests are memoized in `<cache_dir>/hashes.json` by (resolved path, size,
mtime_ns): an edited file changes size or mtime and is re-hashed. Entries are
written to a temporary directory and renamed into place, so a crash never leaves
a half entry under the final name, and a file of an entry is never rewritten in
place (a process that has it mapped keeps its pages); temporary entries of dead
processes are removed by the next save. A damaged entry (bad or missing meta,
a leaf file that is not NumPy's format, truncated, padded, or of another dtype or
shape than meta.json and the config say) and a damaged hash memo are rebuilt,
never a crash (tests/checkpoint/test_crash_safety.py kills the process at the fault points of
`jaxserve.testing.faults`). Not detected: a flipped byte inside a leaf's data (no checksum:
sha256 of the 513 MiB tree would cost ~0.45 s of the start-up, crc32 ~0.3 s).
Entries of the older orbax format (`<sha16>-<dtype>/params/`) are ignored, not
deleted (another checkout may still use them). Clear with `make clean-cache`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.testing import faults
from jaxserve.checkpoint.layout import check_tree
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import ModelConfig, RopeScaling

log = logging.getLogger(__name__)
HASH_MEMO = "hashes.json"
FORMAT = "npy1"  # entry-name suffix and meta.json "format": a new layout gets a new name
_HF_META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "chat_template.jinja")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _memo_path(cache_dir: Path) -> Path:
    return cache_dir / HASH_MEMO


def file_digest(path: Path, cache_dir: Path | None) -> str:
    """sha256 hex digest of `path`, memoized by (path, size, mtime_ns) under `cache_dir`."""
    st = path.stat()
    key = str(path.resolve())
    memo: dict = {}
    if cache_dir is not None and _memo_path(cache_dir).is_file():
        try:
            memo = json.loads(_memo_path(cache_dir).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            memo = {}  # a damaged memo only costs a re-hash
    if not isinstance(memo, dict):
        memo = {}
    hit = memo.get(key)
    if (isinstance(hit, dict) and hit.get("size") == st.st_size
            and hit.get("mtime_ns") == st.st_mtime_ns and isinstance(hit.get("sha256"), str)):
        return hit["sha256"]
    digest = _file_sha256(path)
    if cache_dir is not None:
        memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        cache_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(_memo_path(cache_dir).with_suffix(""))  # a memo write cut short
        tmp = _memo_path(cache_dir).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, _memo_path(cache_dir))
    return digest


def source_digest(source: Path, cache_dir: Path | None) -> str:
    """Content hash of a checkpoint: the .gguf file, or an HF dir's config + weight files."""
    if source.is_file():
        return file_digest(source, cache_dir)
    files = sorted([*(source / n for n in _HF_META_FILES), *source.glob("*.safetensors"),
                    *source.glob("model.safetensors.index.json")])
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(f.name.encode() + b"\0" + file_digest(f, cache_dir).encode() + b"\n")
    return h.hexdigest()


def entry_dir(cache_dir: Path, source: Path, dtype: str) -> Path:
    """`<cache_dir>/<sha256[:16]>-<dtype>-npy1` for this source."""
    return cache_dir / f"{source_digest(source, cache_dir)[:16]}-{dtype}-{FORMAT}"


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{"layers.wq": array, ...}: the tree's leaves under dotted paths (sorted)."""
    out: dict[str, np.ndarray] = {}
    for k in sorted(tree):
        if "." in k or "/" in k:
            raise ValueError(f"params cache: tree key {k!r} contains '.' or '/'")
        v = tree[k]
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        *parents, leaf = path.split(".")
        d = tree
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return tree


def _map_leaf(path: Path, dtype: str, shape: list[int]) -> np.ndarray:
    """Memory-map one leaf copy-on-write, checking it against its meta.json record.

    Raises:
      ValueError: not an .npy file, or its dtype/shape/size differ from the record.
    """
    a = np.load(path, mmap_mode="c", allow_pickle=False)
    if not isinstance(a, np.memmap):
        raise ValueError(f"{path.name}: not a memory-mappable .npy file")
    want = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    if a.dtype != want:  # bfloat16 is stored as its raw 2-byte void type ('<V2')
        if a.dtype.itemsize != want.itemsize or a.dtype.kind != "V" or dtype != "bfloat16":
            raise ValueError(f"{path.name}: dtype {a.dtype} but meta.json says {dtype}")
        a = a.view(want)
    if list(a.shape) != list(shape):
        raise ValueError(f"{path.name}: shape {list(a.shape)} but meta.json says {shape}")
    size = path.stat().st_size
    if size != a.offset + a.nbytes:
        raise ValueError(f"{path.name}: {size} bytes, expected {a.offset + a.nbytes}")
    return a


def _config_from_dict(d: dict) -> ModelConfig:
    rs = d.pop("rope_scaling")
    return ModelConfig(**{**d, "rope_scaling": RopeScaling(**rs) if rs else None,
                          "eos_token_ids": tuple(d["eos_token_ids"])})


def restore(entry: Path) -> tuple[ModelConfig, dict, Tokenizer] | None:
    """(config, NumPy param tree, tokenizer) cached at `entry`, or None when absent/unusable.

    The leaves are copy-on-write memory maps of the entry's .npy files (nothing is
    read until used; see the module docstring). A damaged entry (unreadable or
    foreign meta.json, a leaf file missing, not .npy, truncated, or of the wrong
    dtype/shape, a tree that does not fit the config) is deleted so that the
    caller reconverts and rewrites it.
    """
    if not entry.is_dir():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        cfg = _config_from_dict(meta["config"])
        tok = Tokenizer.from_state(meta["tokenizer"])
        bad = [n for n in meta["leaves"] if "/" in n or "\\" in n or n.startswith(".")]
        if bad:
            raise ValueError(f"meta.json names leaves outside the entry: {bad[:3]}")
        flat = {name: _map_leaf(entry / f"{name}.npy", dt, shape)
                for name, (dt, shape) in meta["leaves"].items()}
        params = _unflatten(flat)
        check_tree(cfg, params, entry)
        return cfg, params, tok
    except Exception as e:  # CheckpointError or any json/npy/OS failure: rebuild
        log.warning("discarding unusable params cache entry %s: %s", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_stale_tmp(entry: Path) -> None:
    """Delete `<entry>.tmp<pid>` dirs (or files: the hash memo's) left by processes that
    died mid-save."""
    for tmp in entry.parent.glob(f"{entry.name}.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[-1]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            log.info("removing stale params-cache temporary %s", tmp)
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def save(entry: Path, cfg: ModelConfig, params: dict, tok: Tokenizer) -> None:
    """Write an entry atomically (temp dir + rename); keep an entry another process wrote.

    One `np.save` per leaf, then meta.json, then the rename. Never raises for the
    file system (a full disk, a read-only cache dir): it logs a warning and leaves
    no temporary, and the caller goes on with its converted tree. Fault points
    (jaxserve.testing.faults): params_cache_write after the leaves, params_cache_rename
    before the rename.
    """
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(entry)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        leaves = {}
        for name, a in _flatten(params).items():
            a = np.ascontiguousarray(a)
            np.save(tmp / f"{name}.npy", a, allow_pickle=False)
            leaves[name] = [a.dtype.name, list(a.shape)]
        faults.crash_point("params_cache_write")
        faults.pause_point("params_cache_pause")
        meta = {"format": FORMAT, "config": dataclasses.asdict(cfg), "tokenizer": tok.to_state(),
                "leaves": leaves}
        (tmp / "meta.json").write_text(json.dumps(meta))
        faults.crash_point("params_cache_rename")
    except OSError as e:  # a full disk or a read-only cache dir costs the next start a conversion
        log.warning("could not write params cache entry %s: %s", entry, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        os.rename(tmp, entry)
    except OSError:  # another process won the race: its entry is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)


def restore_tokenizer(cache_dir: Path, source: Path) -> Tokenizer | None:
    """The tokenizer stored with any dtype's entry for `source`, or None."""
    prefix = source_digest(source, cache_dir)[:16]
    for meta in sorted(cache_dir.glob(f"{prefix}-*/meta.json")):
        try:
            return Tokenizer.from_state(json.loads(meta.read_text())["tokenizer"])
        except Exception as e:  # a damaged entry: fall back to parsing the source
            log.warning("ignoring unusable tokenizer in %s: %s", meta, e)
    return None
