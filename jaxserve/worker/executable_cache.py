"""A disk cache of compiled step programs, so a restart skips tracing, lowering and XLA.

JAX's persistent compilation cache (`enable_compilation_cache`) skips only the
XLA compile: every restart still traces and lowers each program, ~5 s per
SmolLM2 program with the layers unrolled (issue 12). This cache stores the
executable itself with `jax.experimental.serialize_executable` (the same PJRT
serialization the compilation cache uses, plus the input/output pytree
structure, pickled), so a hit is a file read and `deserialize_and_load`:
about 0.1 s per program, no trace at all.

Because nothing is traced on a hit, the key must name everything the program
depends on (`program_key_parts`): the engine config (less the fields that
only steer scheduling), the program family and bucket size, the argument
shapes/dtypes/shardings, the attention backend, device kind and count,
process count, tensor-parallel size, jax/jaxlib versions, XLA flags, the
jax config flags that change lowering, the host CPU's instruction-set flags,
and a sha256 of the source files the program is traced from
(`PROGRAM_SOURCES`), so a code change never loads a stale program.

Layout: `<dir>/<family>_<size>_<sha256(key)[:20]>.jxe`, one file per program:
a magic line, a JSON header (the key parts, the payload's length and
sha256), then the payload. Writes go to a temporary name in the same
directory and are renamed into place (`os.replace`), so concurrent writers
(test workers) and a crash mid-write never leave a half entry under the
final name. A truncated or corrupt entry fails its length/sha256 check (or
unpickling, or loading) and is reported as a miss: the caller rebuilds the
program and `store` replaces the entry. A miss whose key differs from an
entry of the same program only in some parts logs which parts differ.

Security: a cache entry is loaded with pickle and runs native code; point the
cache only at a directory you trust (as for JAX's own compilation cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import platform
import re
import tempfile
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

_UMASK = os.umask(0o022)  # read once, at import (os.umask is process-wide, not thread-safe)
os.umask(_UMASK)
MAGIC = b"JAXSERVE-EXECUTABLE-1\n"
SUFFIX = ".jxe"

# Source files (relative to the jaxserve package; a directory means every *.py in it)
# that the step programs are traced from. A branch that adds code run inside a program
# adds its file here, or a cached program could outlive the code that made it.
# Whole folders (relative to the package root), so a module moved or added inside them
# is covered without editing this list; plus the top-level modules a program reads.
PROGRAM_SOURCES = ("worker", "sample", "model", "attention", "distributed",
                   "scheduler/output.py", "scheduler/buckets.py",
                   "config.py", "sampling_params.py", "validation.py", "errors.py")

# EngineConfig fields that only steer scheduling / serving, never a program. Every other
# field (including ones added later) is part of the key: a new field can only cause a
# miss, never a stale hit. The bucket lists are replaced by the program's own size and
# the row count of the stack (the largest seq bucket), and the KV pool by its resolved size.
_NON_PROGRAM_FIELDS = {
    "cache": ("enable_prefix_caching", "kv_cache_memory_bytes", "num_kv_blocks"),
    "scheduler": ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
                  "policy", "bucket_policy", "bucket_gap", "min_token_bucket", "min_seq_bucket",
                  "token_buckets", "seq_buckets", "static_batching"),
    "": ("strict_compiles", "warmup", "compile_threads",
         "enable_prompt_logprobs",  # the set, not a program
         "async_scheduling", "async_placeholders", "stream_interval",  # host-side only
         "quantization"),  # the flag; the weights' formats are in the arguments' signature
}
# jax config flags that change what a trace lowers to.
_JAX_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
              "jax_default_prng_impl", "jax_threefry_partitionable", "jax_enable_checks",
              "jax_use_shardy_partitioner")


def _source_digest() -> str:
    """sha256 over the `PROGRAM_SOURCES` files (*.py and *.cc; path + content, sorted)."""
    root = Path(__file__).resolve().parent.parent  # the jaxserve package
    files: list[Path] = []
    for rel in PROGRAM_SOURCES:
        p = root / rel
        # *.cc: the native CPU kernels a program calls (attention/native/)
        files += sorted([*p.rglob("*.py"), *p.rglob("*.cc")]) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes() if f.is_file() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()


def _cpu_flags() -> str:
    """The host CPU's instruction-set flags (Linux /proc/cpuinfo; else the machine name)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    m = re.search(r"^(flags|Features)\s*:\s*(.*)$", text, re.M)
    flags = " ".join(sorted(set(m.group(2).split()))) if m else ""
    return f"{platform.machine()}:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _config_parts(config: Any) -> dict:
    """The EngineConfig as a JSON-able dict, without the fields that steer only scheduling."""
    d = dataclasses.asdict(config)
    for group, names in _NON_PROGRAM_FIELDS.items():
        sub = d.get(group, {}) if group else d
        for n in names:
            sub.pop(n, None)
    return d


def _arg_signature(args: Any) -> str:
    """Tree structure, shapes, dtypes and shardings of a program's arguments (no tracing)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    sig = [str(treedef)]
    for x in leaves:
        sig.append(f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:"
                   f"{getattr(x, 'sharding', '')}")
    return hashlib.sha256("\n".join(sig).encode()).hexdigest()


_STATIC_PARTS: dict | None = None


def _static_parts() -> dict:
    """Key parts fixed for the process: versions, devices, flags, CPU, source hash."""
    global _STATIC_PARTS
    if _STATIC_PARTS is None:
        import jaxlib

        devs = jax.devices()
        _STATIC_PARTS = {
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(),
            "platform_version": getattr(devs[0].client, "platform_version", ""),
            "device_kind": devs[0].device_kind, "device_count": len(devs),
            "process_count": jax.process_count(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
            "cpu": _cpu_flags(),
            "source_sha256": _source_digest(),
        }
    parts = dict(_STATIC_PARTS)
    parts["jax_flags"] = {n: str(getattr(jax.config, n, None)) for n in _JAX_FLAGS}
    from jaxserve.attention import native_cpu  # whether decode used the native kernel

    parts["native_cpu_decode"] = native_cpu.status()
    from jaxserve.model import linear, native_fmatmul, native_qmatmul

    parts["native_cpu_qmatmul"] = native_qmatmul.status()
    parts["native_cpu_fmatmul"] = (f"{native_fmatmul.status()} head<={linear.HEAD_NATIVE_MAX_ROWS}"
                                   f" layers<={linear.FLOAT_NATIVE_MAX_ROWS}"
                                   f" many={linear.FLOAT_NATIVE_MANY}")
    return parts


def program_key_parts(config: Any, family: str, size: int, args: Any, *,
                      backend_name: str, extra: dict | None = None) -> dict:
    """Everything one step program depends on, as a JSON-able dict.

    Args:
      config: the `EngineConfig` (see `_NON_PROGRAM_FIELDS` for what is left out).
      family, size: the program key, e.g. ("stack", 64) or ("head", 8).
      args: the program's example arguments (arrays or ShapeDtypeStructs): their
        structure, shapes, dtypes and shardings are hashed, not their values.
      backend_name: the resolved attention backend's class name.
      extra: more parts (e.g. the stack's row count).
    """
    parts = _static_parts()
    parts.update({
        # config carries tensor_parallel_size (and every other program-shaping field)
        "family": family, "size": int(size), "config": _config_parts(config),
        "attention_backend": backend_name, "args": _arg_signature(args),
    })
    parts.update(extra or {})
    return parts


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


DEFAULT_MAX_BYTES = 512 << 20  # ~100 program sets of the default model's layer-group programs


class ExecutableCache:
    """Serialized AOT executables on disk, one file per (program, key).

    Args:
      directory: where entries live (created on the first store).
      max_bytes: size cap of the directory's entries. After each store the least
        recently used entries (file mtime; `load` touches an entry it returns) are
        deleted until the rest fit, as JAX's persistent compile cache does with
        `jax_compilation_cache_max_size`; the entry just stored is always kept.
        None: no cap.

    `load` returns None on a miss (logging why at INFO: no entry, or which
    key parts differ from an entry of the same program) and on a damaged
    entry (logged at WARNING); it never raises for a bad file. `store` writes
    atomically and never raises either (a full disk only costs the next start
    a rebuild).
    """

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int | None = DEFAULT_MAX_BYTES):
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        if jax.default_backend() == "cpu":
            # Build and register the native matmul kernels now, on this thread, before any
            # key is made: a restored program is never traced, so their status would read
            # "not tried" in its key and no FFI handler would exist for its custom calls.
            from jaxserve.model import native_fmatmul, native_qmatmul

            native_qmatmul.available()
            native_fmatmul.available()

    def path(self, parts: dict) -> Path:
        return self.dir / f"{parts['family']}_{parts['size']}_{_digest(parts)[:20]}{SUFFIX}"

    @staticmethod
    def _read(path: Path) -> tuple[dict, bytes]:
        """(header, payload) of an entry. Raises ValueError for a damaged one."""
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError("bad magic")
        nl = data.find(b"\n", len(MAGIC))
        if nl < 0:
            raise ValueError("truncated header")
        header = json.loads(data[len(MAGIC):nl])
        payload = data[nl + 1:]
        if len(payload) != header["payload_bytes"]:
            raise ValueError(f"payload is {len(payload)} bytes, header says "
                             f"{header['payload_bytes']} (truncated)")
        if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
            raise ValueError("payload sha256 mismatch (corrupt)")
        return header, payload

    def _why_missed(self, parts: dict) -> str:
        """Which key parts differ from the newest entry of the same program, if any."""
        others = sorted(self.dir.glob(f"{parts['family']}_{parts['size']}_*{SUFFIX}"),
                        key=lambda p: p.stat().st_mtime, reverse=True) if self.dir.is_dir() else []
        for p in others:
            try:
                data = p.read_bytes()[:1 << 20]
                header = json.loads(data[len(MAGIC):data.index(b"\n", len(MAGIC))])
            except (OSError, ValueError):
                continue
            mine = _flatten(json.loads(json.dumps(parts, default=str)))  # tuples as lists
            theirs = _flatten(header.get("key", {}))
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            shown = ", ".join(f"{k}: {theirs.get(k)!r} -> {mine.get(k)!r}"[:160] for k in diff[:4])
            more = f" (+{len(diff) - 4} more)" if len(diff) > 4 else ""
            return f"key changed since {p.name}: {shown}{more}"
        return "no cached entry"

    def load(self, parts: dict) -> Any | None:
        """The cached `jax.stages.Compiled` for `parts`, or None (miss or damaged entry)."""
        from jax.experimental import serialize_executable

        path = self.path(parts)
        name = f"{parts['family']} {parts['size']}"
        if not path.is_file():
            # DEBUG: one line per program would flood a normal start (the warm-up summary
            # counts what was restored); -v shows why each one missed.
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("executable cache miss for %s: %s", name, self._why_missed(parts))
            return None
        try:
            header, payload = self._read(path)
            if header.get("key") != json.loads(json.dumps(parts, default=str)):
                raise ValueError("stored key differs from the requested one (hash collision?)")
            serialized, in_tree, out_tree = pickle.loads(payload)
            program = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
            try:
                os.utime(path)  # recently used: the size cap evicts the others first
            except OSError:
                pass
            return program
        except Exception as e:  # noqa: BLE001 - a bad entry is rebuilt, never a crash
            logger.warning("executable cache entry %s for %s is unusable (%s: %s); rebuilding it",
                           path.name, name, type(e).__name__, e)
            return None

    def _remove_dead_temporaries(self) -> None:
        """Delete temporary files whose writer process is gone (killed mid-write)."""
        for tmp in self.dir.glob(".*.tmp"):
            try:
                pid = int(tmp.name.split(".")[2])
                os.kill(pid, 0)  # raises if no such process
            except ProcessLookupError:
                logger.info("removing the executable-cache temporary %s of a dead process",
                            tmp.name)
                tmp.unlink(missing_ok=True)
            except (ValueError, IndexError, PermissionError, OSError):
                continue

    def evict(self, keep: Path | None = None) -> int:
        """Delete least-recently-used entries until the total fits `max_bytes` (never
        `keep`); returns how many were deleted. Races with other writers are harmless:
        a file gone already is skipped, and a deleted entry only costs a rebuild."""
        if self.max_bytes is None:
            return 0
        entries = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            try:
                p.unlink()
            except OSError:
                continue
            total -= size
            removed += 1
        if removed:
            logger.info("executable cache: evicted %d least recently used entries (cap %d MiB)",
                        removed, self.max_bytes >> 20)
        return removed

    def store(self, parts: dict, compiled: Any) -> bool:
        """Write `compiled` under `parts` (atomically); False (logged) if it could not be."""
        from jax.experimental import serialize_executable

        path = self.path(parts)
        tmp = None
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled),
                                   protocol=pickle.HIGHEST_PROTOCOL)
            header = {"key": parts, "payload_bytes": len(payload),
                      "payload_sha256": hashlib.sha256(payload).hexdigest()}
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_dead_temporaries()
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.{os.getpid()}.", suffix=".tmp",
                                       dir=self.dir)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC)
                f.write(json.dumps(header, sort_keys=True, default=str).encode() + b"\n")
                f.write(payload)
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide it from other users
            os.replace(tmp, path)
            self.evict(keep=path)
            return True
        except Exception as e:  # noqa: BLE001 - caching is an optimisation
            logger.warning("could not store %s in the executable cache (%s: %s)", path.name,
                           type(e).__name__, e)
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            return False
