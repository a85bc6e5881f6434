"""Orbax cache of converted parameter trees, keyed by the source's content hash and dtype.

Layout: `<cache_dir>/<sha256(source)[:16]>-<dtype>/` holds `params/`, one
orbax `StandardCheckpointer` checkpoint of the converted NumPy tree, and
`meta.json` (the ModelConfig and the serialized Tokenizer), so a hit needs
neither the GGUF metadata parse (~4 s for SmolLM2's 49k-token vocabulary in
`GGUFReader`) nor any conversion. A GGUF's key hashes the whole file; an HF
dir's key hashes config/tokenizer files and every *.safetensors / index file
(name + content). Hashing 100 MB takes ~0.3 s, so
digests are memoized in `<cache_dir>/hashes.json` by (resolved path, size,
mtime_ns): an edited file changes size or mtime and is re-hashed. Entries are
written to a temporary directory and renamed into place, so a crash never
leaves a half entry under the final name; temporary entries of dead processes
are removed by the next save, and a damaged entry or hash memo is rebuilt,
never a crash (tests/test_crash_safety.py kills the process at the fault
points of `jaxserve.faults`). Clear with `make clean-cache`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from jaxserve import faults
from jaxserve.checkpoint.layout import check_tree
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import ModelConfig, RopeScaling

log = logging.getLogger(__name__)
HASH_MEMO = "hashes.json"
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
    """`<cache_dir>/<sha256[:16]>-<dtype>` for this source."""
    return cache_dir / f"{source_digest(source, cache_dir)[:16]}-{dtype}"


def _config_from_dict(d: dict) -> ModelConfig:
    rs = d.pop("rope_scaling")
    return ModelConfig(**{**d, "rope_scaling": RopeScaling(**rs) if rs else None,
                          "eos_token_ids": tuple(d["eos_token_ids"])})


def restore(entry: Path) -> tuple[ModelConfig, dict, Tokenizer] | None:
    """(config, NumPy param tree, tokenizer) cached at `entry`, or None when absent/unusable.

    A damaged entry (unreadable meta, failed orbax restore, wrong shapes) is
    deleted so that the caller reconverts and rewrites it.
    """
    if not entry.is_dir():
        return None
    import orbax.checkpoint as ocp  # heavy import (~1.5 s): only when a cache is used

    try:
        meta = json.loads((entry / "meta.json").read_text())
        cfg = _config_from_dict(meta["config"])
        tok = Tokenizer.from_state(meta["tokenizer"])
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore((entry / "params").resolve())
        check_tree(cfg, params, entry)
        return cfg, params, tok
    except Exception as e:  # CheckpointError or any json/orbax/tensorstore failure: rebuild
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
    """Delete `<entry>.tmp<pid>` dirs left by processes that died mid-save."""
    for tmp in entry.parent.glob(f"{entry.name}.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[-1]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            log.info("removing stale params-cache temporary %s", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def save(entry: Path, cfg: ModelConfig, params: dict, tok: Tokenizer) -> None:
    """Write an entry atomically (temp dir + rename); keep an entry another process wrote.

    Fault points (jaxserve.faults): params_cache_write after the params,
    params_cache_rename before the rename.
    """
    import orbax.checkpoint as ocp

    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(entry)
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((tmp / "params").resolve(), params)
    faults.crash_point("params_cache_write")
    meta = {"config": dataclasses.asdict(cfg), "tokenizer": tok.to_state()}
    (tmp / "meta.json").write_text(json.dumps(meta))
    faults.crash_point("params_cache_rename")
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
