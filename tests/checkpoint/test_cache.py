"""Orbax params cache: a hit skips conversion; keys follow content and dtype."""

from __future__ import annotations

import json
import os
import shutil

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
    assert len(entries) == 1 and entries[0].name.endswith("-float32") and len(entries[0].name) == 16 + 8
    monkeypatch.setattr(gguf_loader, "dequantize_tensor", _boom)
    monkeypatch.setattr(gguf_loader, "open_gguf", _boom)  # config + tokenizer come from meta.json
    monkeypatch.setattr(cache, "_file_sha256", _boom)  # (path, size, mtime) memo: no re-hash either
    cfg2, p2, tok2 = load_model(src, cache_dir=tmp_path / "c", progress=False)
    assert cfg1 == cfg2
    _same(p1, p2)
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
