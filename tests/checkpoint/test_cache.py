"""Params cache (one .npy per leaf, memory-mapped): a hit skips conversion; keys follow content and dtype."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxserve.checkpoint import cache, gguf_loader, hf, load_model, load_tokenizer

from .conftest import FIXTURES, TINY_GGUF_F32


def _boom(*a, **k):
    raise AssertionError("conversion ran although the params cache should have been hit")


def _same(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_gguf_cache_hit_skips_dequantization(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    shutil.copy(FIXTURES / "tiny_gguf" / "tiny-q8_0.gguf", src)
    cfg1, p1, tok1 = load_model(src, cache_dir=tmp_path / "c", progress=False)
    entries = [e for e in (tmp_path / "c").iterdir() if e.is_dir()]
    assert len(entries) == 1 and entries[0].name.endswith("-float32-npy1")
    assert len(entries[0].name) == 16 + len("-float32-npy1")
    assert sorted(f.name for f in entries[0].iterdir()) == sorted(
        ["meta.json", "embed.npy", "final_norm.npy",
         *(f"layers.{k}.npy" for k in p1["layers"]), *(["lm_head.npy"] if "lm_head" in p1 else [])])
    monkeypatch.setattr(gguf_loader, "dequantize_tensor", _boom)
    monkeypatch.setattr(gguf_loader, "open_gguf", _boom)  # config + tokenizer come from meta.json
    monkeypatch.setattr(cache, "_file_sha256", _boom)  # (path, size, mtime) memo: no re-hash either
    cfg2, p2, tok2 = load_model(src, cache_dir=tmp_path / "c", progress=False)
    assert cfg1 == cfg2
    _same(p1, p2)
    # A hit maps the files copy-on-write: no read, and a write never reaches the file.
    assert isinstance(p2["embed"], np.memmap) and p2["embed"].mode == "c"
    before = (entries[0] / "embed.npy").read_bytes()
    p2["embed"][0, 0] += 1.0
    assert (entries[0] / "embed.npy").read_bytes() == before
    msgs = [{"role": "user", "content": "the cat, 42!"}]
    assert tok2.apply_chat_template(msgs) == tok1.apply_chat_template(msgs)
    assert (tok2.bos_token_id, tok2.eos_token_id, tok2.all_special_ids, tok2.vocab_size) == \
        (tok1.bos_token_id, tok1.eos_token_id, tok1.all_special_ids, tok1.vocab_size)


def test_hf_cache_hit_and_dtype_key(tmp_path, monkeypatch):
    c = tmp_path / "c"
    _, p32, _ = load_model(FIXTURES / "tiny_untied", cache_dir=c, progress=False)
    _, p16, _ = load_model(FIXTURES / "tiny_untied", dtype="bfloat16", cache_dir=c, progress=False)
    assert sorted(e.name.split("-")[1] for e in c.iterdir() if e.is_dir()) == ["bfloat16", "float32"]
    monkeypatch.setattr(hf, "read_safetensors", _boom)
    _, q16, _ = load_model(FIXTURES / "tiny_untied", dtype="bfloat16", cache_dir=c, progress=False)
    _same(p16, q16)
    assert str(q16["embed"].dtype) == "bfloat16"
    assert all(str(v.dtype) == "bfloat16" for v in q16["layers"].values())


def test_changed_file_is_reconverted(tmp_path):
    src = tmp_path / "m.gguf"
    shutil.copy(TINY_GGUF_F32, src)
    c = tmp_path / "c"
    load_model(src, cache_dir=c, progress=False)
    digest1 = json.loads((c / "hashes.json").read_text())[str(src.resolve())]["sha256"]
    assert digest1 == cache._file_sha256(src)
    shutil.copy(FIXTURES / "tiny_gguf" / "tiny-q8_0.gguf", src)  # new content, same path
    os.utime(src, ns=(1, 1))
    _, p, _ = load_model(src, cache_dir=c, progress=False)
    assert len([e for e in c.iterdir() if e.is_dir()]) == 2
    _, want, _ = gguf_loader.load_gguf(FIXTURES / "tiny_gguf" / "tiny-q8_0.gguf", progress=False)
    _same(want, p)


def test_damaged_entry_is_rebuilt(tmp_path):
    c = tmp_path / "c"
    _, p1, _ = load_model(TINY_GGUF_F32, cache_dir=c, progress=False)
    entry = next(e for e in c.iterdir() if e.is_dir())
    for f in entry.rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    _, p2, _ = load_model(TINY_GGUF_F32, cache_dir=c, progress=False)
    _same(p1, p2)


def _entry_and_reference(tmp_path):
    c = tmp_path / "c"
    _, want, _ = load_model(TINY_GGUF_F32, cache_dir=c, progress=False)
    return c, next(e for e in c.iterdir() if e.is_dir()), want


def _meta_edit(entry, fn):
    meta = json.loads((entry / "meta.json").read_text())
    fn(meta)
    (entry / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", [
    "truncate_leaf", "pad_leaf", "empty_leaf", "garbage_leaf", "missing_leaf", "pickled_leaf",
    "wrong_leaf_shape", "wrong_leaf_dtype", "meta_shape", "meta_missing", "meta_truncated",
    "old_format", "meta_leaf_outside"])
def test_corrupt_entry_is_rebuilt_not_crashed(tmp_path, damage, caplog):
    """Each way an entry can be damaged: the load logs it, deletes the entry, reconverts
    (the same tree as the first load) and writes a good entry, which the next load hits."""
    c, entry, want = _entry_and_reference(tmp_path)
    leaf = entry / "layers.wq.npy"
    raw = leaf.read_bytes()
    if damage == "truncate_leaf":
        leaf.write_bytes(raw[:len(raw) // 2])
    elif damage == "pad_leaf":
        leaf.write_bytes(raw + b"\0" * 64)
    elif damage == "empty_leaf":
        leaf.write_bytes(b"")
    elif damage == "garbage_leaf":
        leaf.write_bytes(os.urandom(len(raw)))
    elif damage == "missing_leaf":
        leaf.unlink()
    elif damage == "pickled_leaf":
        np.save(leaf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    elif damage == "wrong_leaf_shape":
        np.save(leaf, np.zeros((3, 5), np.float32))
    elif damage == "wrong_leaf_dtype":
        np.save(leaf, np.load(leaf).astype(np.float64))
    elif damage == "meta_shape":  # meta agrees with the file, neither with the config
        np.save(leaf, np.zeros((3, 5), np.float32))
        _meta_edit(entry, lambda m: m["leaves"].__setitem__("layers.wq", ["float32", [3, 5]]))
    elif damage == "meta_missing":
        (entry / "meta.json").unlink()
    elif damage == "meta_truncated":
        (entry / "meta.json").write_bytes((entry / "meta.json").read_bytes()[:100])
    elif damage == "old_format":
        _meta_edit(entry, lambda m: m.pop("format"))
    elif damage == "meta_leaf_outside":  # a leaf path that would leave the entry dir
        np.save(tmp_path / "outside.npy", np.load(leaf))
        _meta_edit(entry, lambda m: m["leaves"].__setitem__(
            "../../outside", m["leaves"].pop("layers.wq")))
    monkeypatch_calls = []
    real_save = cache.save

    def counting_save(*a, **k):
        monkeypatch_calls.append(a[0])
        return real_save(*a, **k)

    cache.save, saved = counting_save, cache.save
    try:
        with caplog.at_level("WARNING", logger="jaxserve.checkpoint.cache"):
            _, got, _ = load_model(TINY_GGUF_F32, cache_dir=c, progress=False)
    finally:
        cache.save = saved
    _same(want, got)
    assert monkeypatch_calls == [entry], "the damaged entry was not rewritten"
    assert any("discarding unusable params cache entry" in r.message and str(entry) in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    assert not list(c.glob("*.tmp*"))
    # The rewritten entry is whole: the next load maps it without converting.
    hit = cache.restore(entry)
    assert hit is not None
    _same(want, hit[1])


def test_meta_naming_a_file_outside_the_entry_is_never_read(tmp_path, monkeypatch):
    c, entry, _ = _entry_and_reference(tmp_path)
    np.save(tmp_path / "outside.npy", np.zeros(3, np.float32))
    _meta_edit(entry, lambda m: m["leaves"].__setitem__("../../outside", ["float32", [3]]))
    opened = []
    real = cache.np.load
    monkeypatch.setattr(cache.np, "load", lambda p, *a, **k: opened.append(p) or real(p, *a, **k))
    assert cache.restore(entry) is None
    assert not entry.exists()
    assert all(Path(p).resolve().parent == entry for p in opened), opened


def test_entry_of_the_older_orbax_layout_is_left_alone(tmp_path):
    """An entry named as the orbax cache named it (`<sha16>-<dtype>/params/`, another
    checkout's) is neither read nor deleted; the new entry sits next to it."""
    c = tmp_path / "c"
    old = c / f"{cache.source_digest(TINY_GGUF_F32, c)[:16]}-float32"
    (old / "params").mkdir(parents=True)
    (old / "params" / "x").write_text("orbax data")
    _, p, _ = load_model(TINY_GGUF_F32, cache_dir=c, progress=False)
    assert (old / "params" / "x").read_text() == "orbax data"
    assert cache.entry_dir(c, TINY_GGUF_F32, "float32").is_dir()


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
    """Four processes load (convert, save) the same model into one empty cache at once:
    one rename wins, the others drop their temporaries, and the entry is whole."""
    import subprocess
    import sys

    c = tmp_path / "c"
    code = ("import sys; from jaxserve.checkpoint import load_model; "
            "load_model(sys.argv[1], cache_dir=sys.argv[2], progress=False)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(TINY_GGUF_F32), str(c)], env=env)
             for _ in range(4)]
    assert [p.wait(timeout=300) for p in procs] == [0] * 4
    entry = cache.entry_dir(c, TINY_GGUF_F32, "float32")
    assert sorted(e.name for e in c.iterdir()) == sorted([entry.name, "hashes.json"])
    hit = cache.restore(entry)
    assert hit is not None
    _same(load_model(TINY_GGUF_F32, cache_dir=None, progress=False)[1], hit[1])


def test_failed_write_is_a_warning_not_a_crash(tmp_path, monkeypatch, caplog):
    """A full disk while saving: load_model still returns the converted tree, the warning
    names the entry, and no temporary or entry is left (the next load converts again)."""
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    c = tmp_path / "c"
    monkeypatch.setattr(cache.np, "save", full)
    with caplog.at_level("WARNING", logger="jaxserve.checkpoint.cache"):
        _, got, _ = load_model(TINY_GGUF_F32, cache_dir=c, progress=False)
    _same(load_model(TINY_GGUF_F32, cache_dir=None, progress=False)[1], got)
    assert any("could not write params cache entry" in r.message and "No space" in r.message
               for r in caplog.records)
    assert [e.name for e in c.iterdir()] == ["hashes.json"]


def test_no_cache_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "save", _boom)
    load_model(TINY_GGUF_F32, cache_dir=None, progress=False)


def test_load_tokenizer_uses_cache_entry(tmp_path, monkeypatch):
    c = tmp_path / "c"
    _, _, tok1 = load_model(TINY_GGUF_F32, cache_dir=c, progress=False)
    monkeypatch.setattr(gguf_loader, "open_gguf", _boom)
    tok2 = load_tokenizer(TINY_GGUF_F32, cache_dir=c)
    assert tok2.encode("the red fox, 2024!") == tok1.encode("the red fox, 2024!")
    with pytest.raises(AssertionError, match="conversion ran"):  # no entry -> parses the file
        load_tokenizer(TINY_GGUF_F32, cache_dir=tmp_path / "empty")


def test_hash_memo_write_cut_short_by_a_kill_is_cleaned_up(tmp_path):
    """A process killed between the memo's temporary write and its rename leaves
    `hashes.tmp<pid>`; the next memo write removes it (a live writer's is kept)."""
    src = tmp_path / "weights.bin"
    src.write_bytes(b"abc")
    caches = tmp_path / "params"
    caches.mkdir()
    dead = caches / "hashes.tmp999999999"  # no such pid
    dead.write_text("{")
    live = caches / f"hashes.tmp{os.getpid()}x"  # not a pid: stale too
    live.write_text("{")
    mine = caches / f"hashes.tmp{os.getppid()}"  # a live process's: kept
    mine.write_text("{")
    import hashlib
    assert cache.file_digest(src, caches) == hashlib.sha256(b"abc").hexdigest()
    assert not dead.exists() and not live.exists() and mine.exists()
    assert json.loads((caches / "hashes.json").read_text())  # the memo itself is intact
