"""The pure parts of `jaxserve bench compare`: flags, KV arithmetic, log parsing, the ratio table.

Expected values are computed by hand in the comments; nothing here builds
llama.cpp or starts a model server (the one server started is a 10-line
Python HTTP stub, to check start-up, PID stop and the /proc read).
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxserve.bench import compare as cmp
from jaxserve.bench import servers

MODEL = Path(__file__).resolve().parents[2] / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"


# ------------------------------------------------------------ flags and cases
def test_parse_case_and_errors():
    assert cmp.parse_case("16:ragged64:arrivals") == cmp.Case(16, "ragged64", "arrivals")
    assert cmp.parse_case("8:/x/t.jsonl:burst").trace == "/x/t.jsonl"
    for bad, needle in (("16:seed8", "N:TRACE:MODE"), ("0:seed8:burst", "N='0'"),
                        ("x:seed8:burst", "N='x'"), ("8:seed8:poisson", "'poisson'"),
                        ("8::burst", "empty")):
        with pytest.raises(ValueError, match=needle):
            cmp.parse_case(bad)


def test_profiles_and_defaults(tmp_path):
    a, cases = cmp.resolve_args([])
    assert [c.key for c in cases] == [
        "8:seed8:burst", "8:ragged64:burst", "8:ragged64:arrivals",
        "16:seed8:burst", "16:ragged64:burst", "16:ragged64:arrivals"]
    assert a.engines == ("llama.cpp", "llama.cpp f32kv", "llama.cpp gguf", "jaxserve",
                         "jaxserve gguf") and a.num_prompts is None
    assert a.output_json == a.out_dir / "compare.json"
    a, cases = cmp.resolve_args(["--profile=issue"])
    assert [c.key for c in cases] == ["16:seed8:burst", "16:ragged64:burst",
                                      "16:ragged64:arrivals", "8:seed8:burst"]
    # short: one small case with its first 16 requests; an explicit --case replaces the profile
    a, cases = cmp.resolve_args(["--profile=short"])
    assert [c.key for c in cases] == ["8:ragged64:burst"] and a.num_prompts == 16
    a, cases = cmp.resolve_args(["--profile=short", "--case=4:seed8:burst", "--case=2:seed8:burst",
                                 "--engines=jaxserve"])
    assert [c.key for c in cases] == ["4:seed8:burst", "2:seed8:burst"]
    assert a.num_prompts is None and a.engines == ("jaxserve", "jaxserve gguf")
    a, _ = cmp.resolve_args(["--configs=jaxserve gguf,llama.cpp gguf"])
    assert a.engines == ("llama.cpp gguf", "jaxserve gguf")
    with pytest.raises(ValueError, match=r"unknown configuration\(s\) \['llama'\]"):
        cmp.resolve_args(["--configs=llama"])
    # the f16-KV configurations run only when named, and pair with llama.cpp's f16 KV
    a, _ = cmp.resolve_args(["--configs=jaxserve gguf f16kv,llama.cpp gguf,jaxserve f16kv",
                             "--kv_tokens=32768"])
    assert a.engines == ("llama.cpp gguf", "jaxserve f16kv", "jaxserve gguf f16kv")
    cmd = cmp.server_command("jaxserve gguf f16kv", a, 16, cmp.plan_kv(a.kv_tokens, 16), 9001)
    assert "--kv_cache_dtype=float16" in cmd and "--quantization=auto" in cmd
    assert "--num_kv_blocks=2049" in cmd  # 32768 / 16 + the null block
    assert ("jaxserve gguf f16kv", "llama.cpp gguf") in cmp.PAIRS
    with pytest.raises(ValueError, match="--kv_tokens=0 must be >= 1"):
        cmp.resolve_args(["--kv_tokens=0"])
    with pytest.raises(ValueError, match="--kv_tokens=4096 and --kv_cache_mib=256 both"):
        cmp.resolve_args(["--kv_tokens=4096", "--kv_cache_mib=256"])
    with pytest.raises(ValueError, match="--kv_tokens=4096 and --kv_cache_mib=512 both"):
        cmp.resolve_args(["--kv_tokens=4096", "--kv_cache_mib=512"])  # the default, named
    # the capacity both engines get: --kv_tokens, else jaxserve's default pool (11632 tokens)
    a.kv_bytes_per_token = cmp.kv_bytes_per_token(30, 3, 64)
    assert cmp.capacity_tokens(a) == 32768
    a, _ = cmp.resolve_args([])
    a.kv_bytes_per_token = cmp.kv_bytes_per_token(30, 3, 64)
    assert cmp.capacity_tokens(a) == 11632


def test_llama_binary_flags(tmp_path):
    a, _ = cmp.resolve_args([f"--llama_server={tmp_path}/bin/llama-server"])
    assert a.llama_quantize == tmp_path / "bin" / "llama-quantize"
    with pytest.raises(ValueError, match="--llama_quantize needs --llama_server"):
        cmp.resolve_args(["--llama_quantize=/q"])
    with pytest.raises(ValueError, match="--num_prompts=0"):
        cmp.resolve_args(["--num_prompts=0"])


def test_main_rejects_a_missing_trace_before_building(tmp_path, capsys):
    rc = cmp.main([f"--traces_dir={tmp_path}", "--case=8:nope:burst", f"--cache_dir={tmp_path}/c"])
    assert rc == 2
    assert f"{tmp_path}/nope.jsonl does not exist" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # no download, no build was started


def test_resolve_trace(tmp_path):
    (tmp_path / "seed8.jsonl").write_text("{}\n")
    assert cmp.resolve_trace("seed8", tmp_path) == tmp_path / "seed8.jsonl"
    assert cmp.resolve_trace(str(tmp_path / "seed8.jsonl"), Path("/elsewhere")) == tmp_path / "seed8.jsonl"


# ------------------------------------------------------------ KV capacity
def test_kv_arithmetic_for_smollm2():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 576/9 = 64, fp32 -> 2*30*3*64*4 bytes.
    bpt = cmp.kv_bytes_per_token(30, 3, 64, 4)
    assert bpt == 46080
    # 512 MiB / (16 * 46080 B) = 536870912 / 737280 = 728.17 -> 728 blocks; minus the null
    # block: 727 * 16 = 11632 tokens (the figure issue 11 quotes for jaxserve's pool).
    assert cmp.jaxserve_pool_tokens(512, 16, bpt) == 11632
    # llama.cpp pads n_ctx to 256: ceil(11632 / 256) = 46 -> 11776 = 736 blocks + the null block.
    assert cmp.plan_kv(11632, 16) == cmp.KVPlan(tokens=11776, jaxserve_num_kv_blocks=737,
                                                llama_ctx=11776)
    assert cmp.plan_kv(11520, 16) == cmp.KVPlan(11520, 721, 11520)  # already a multiple of 256
    assert cmp.plan_kv(1, 16) == cmp.KVPlan(256, 17, 256)


def test_kv_arithmetic_errors():
    with pytest.raises(ValueError, match="holds 1 blocks"):
        cmp.jaxserve_pool_tokens(1, 16, 46080)  # 1048576 B / 737280 B per block = 1.42 -> 1
    with pytest.raises(ValueError, match="tokens=0"):
        cmp.plan_kv(0, 16)
    with pytest.raises(ValueError, match="block_size=48"):
        cmp.plan_kv(100, 48)


@pytest.mark.skipif(not MODEL.is_file(), reason="default GGUF not fetched (make model)")
def test_gguf_kv_dims_match_the_hf_config():
    # HF SmolLM2-135M-Instruct config.json: num_hidden_layers 30, num_key_value_heads 3,
    # hidden_size 576 / num_attention_heads 9 = 64.
    assert cmp.gguf_kv_dims(MODEL) == (30, 3, 64)


# ------------------------------------------------------------ logs and /proc
def test_parse_kv_logs():
    js = ("2026-12-01 11:20:00 jaxserve.engine.core: KV cache: 737 blocks x 16 tokens = 11776 tokens "
          "(518.2 MiB), 5.8 concurrent sequences of max_model_len=2048\n")
    assert cmp.parse_kv_log(js, "jaxserve") == {"tokens": 11776, "mib": 518.2}
    ll = ("llama_kv_cache:        CPU KV buffer size =   517.50 MiB\n"
          "llama_kv_cache: size =  517.50 MiB ( 11776 cells,  30 layers, 16/1 seqs), "
          "K (f32):  258.75 MiB, V (f32):  258.75 MiB\n")
    assert cmp.parse_kv_log(ll, "llama.cpp") == {"tokens": 11776, "mib": 517.5}
    assert cmp.parse_kv_log("nothing here", "jaxserve") is None
    assert cmp.parse_kv_log(js, "llama.cpp") is None
    f16 = js.replace("MiB), ", "MiB), float16, ")  # the log names the KV dtype since issue 26
    assert cmp.parse_kv_log(f16, "jaxserve gguf") == {"tokens": 11776, "mib": 518.2}
    assert cmp.parse_kv_log(ll, "llama.cpp gguf") == {"tokens": 11776, "mib": 517.5}


def test_parse_proc_status():
    text = "Name:\tpython\nVmPeak:\t 9999999 kB\nVmHWM:\t 1484800 kB\nVmRSS:\t 1024000 kB\n"
    # kB / 1024: 1484800 / 1024 = 1450.0 MiB, 1024000 / 1024 = 1000.0 MiB; VmPeak (virtual) ignored
    assert servers.parse_proc_status(text) == {"VmHWM": 1450.0, "VmRSS": 1000.0}


def test_tree_proc_status_adds_the_child_processes(tmp_path):
    """A server's engine process (`--engine_process`) counts in its RSS: a child holding
    64 MiB makes the tree's peak at least this process's plus the child's."""
    import subprocess

    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, time; x = bytearray(64 << 20); x[::4096] = b'1' * len(x[::4096]); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(30)")])
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        own = servers.parse_proc_status(Path("/proc/self/status").read_text())
        kid = servers.parse_proc_status(Path(f"/proc/{child.pid}/status").read_text())
        tree = servers.tree_proc_status(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert kid["VmHWM"] >= 64
    assert tree["VmHWM"] >= own["VmHWM"] + kid["VmHWM"]


# ------------------------------------------------------------ the ratio table
def _rec(case, engine, tok_s, ttft, rss, kv):
    return {"case": case, "engine": engine, "tok_s": tok_s, "ttft_mean_s": ttft,
            "peak_rss_mib": rss, "kv_tokens": kv}


def test_ratio_rows_hand_computed():
    records = [_rec("16:seed8:burst", "llama.cpp", 50.0, 2.0, 1500.0, 11776),
               _rec("16:seed8:burst", "jaxserve", 25.0, 3.0, 3000.0, 11776),
               _rec("8:ragged64:burst", "llama.cpp", 120.0, 6.0, 1200.0, 11776),
               _rec("8:ragged64:burst", "jaxserve", 150.0, 4.5, 1080.0, 11776),
               _rec("8:seed8:burst", "jaxserve", 30.0, 1.0, 900.0, 11776),
               _rec("8:seed8:burst", "jaxserve gguf", 60.0, 0.5, 600.0, 11776),
               _rec("8:seed8:burst", "llama.cpp gguf", 80.0, 0.4, 500.0, 11776)]
    rows = cmp.ratio_rows(records)
    # the jaxserve vs llama.cpp (F32, default KV) pair, as before; f32kv's pair has only
    # jaxserve's values (no llama.cpp f32kv record), the gguf pair both: 60/80, 0.5/0.4
    got = {(r["case"], r["measure"]): (r["ratio"], r["met"]) for r in rows
           if r["pair"] == "jaxserve vs llama.cpp"}
    gguf = {r["measure"]: r["ratio"] for r in rows if r["pair"] == "jaxserve gguf vs llama.cpp gguf"}
    assert gguf["throughput"] == pytest.approx(0.75) and gguf["mean TTFT"] == pytest.approx(1.25)
    assert {r["pair"] for r in rows if r["case"] == "16:seed8:burst"} == {
        "jaxserve vs llama.cpp", "jaxserve vs llama.cpp f32kv"}
    # 25/50 = 0.5 (goal >= 1: no); 3/2 = 1.5 (goal <= 1: no); 3000/1500 = 2.0 (no); 1.0 (=1: yes)
    assert got[("16:seed8:burst", "throughput")] == (0.5, False)
    assert got[("16:seed8:burst", "mean TTFT")] == (1.5, False)
    assert got[("16:seed8:burst", "peak RSS")] == (2.0, False)
    assert got[("16:seed8:burst", "KV capacity")] == (1.0, True)
    # 150/120 = 1.25 (yes); 4.5/6 = 0.75 (yes); 1080/1200 = 0.9 (yes)
    assert got[("8:ragged64:burst", "throughput")] == (pytest.approx(1.25), True)
    assert got[("8:ragged64:burst", "mean TTFT")] == (pytest.approx(0.75), True)
    assert got[("8:ragged64:burst", "peak RSS")] == (pytest.approx(0.9), True)
    # a jaxserve-only case: no ratio, nothing judged
    assert got[("8:seed8:burst", "throughput")] == (None, None)
    assert [r["case"] for r in rows[::4]] == ["16:seed8:burst"] * 2 + ["8:ragged64:burst"] * 2 + [
        "8:seed8:burst"] * 3

    table = cmp.format_table(rows).splitlines()
    assert len(table) == 2 + 7 * 4
    assert table[2] == ("| 16:seed8:burst | jaxserve vs llama.cpp | throughput (tok/s) | 50.00 | "
                        "25.00 | 0.50 | ≥1 no |")
    assert table[4] == ("| 16:seed8:burst | jaxserve vs llama.cpp | peak RSS (MiB) | 1500 | 3000 | "
                        "2.00 | ≤1 no |")
    assert table[6] == ("| 16:seed8:burst | jaxserve vs llama.cpp f32kv | throughput (tok/s) | – | "
                        "25.00 | – | ≥1 – |")


def test_ratio_rows_of_an_opt_in_configuration():
    """An opt-in configuration (jaxserve gguf f16kv) gets its pair's rows only where it ran."""
    base = [_rec("16:seed8:burst", "llama.cpp gguf", 80.0, 0.4, 500.0, 32768),
            _rec("16:seed8:burst", "jaxserve gguf", 60.0, 0.5, 600.0, 32768)]
    assert {r["pair"] for r in cmp.ratio_rows(base)} == {"jaxserve gguf vs llama.cpp gguf"}
    rows = cmp.ratio_rows(base + [_rec("16:seed8:burst", "jaxserve gguf f16kv", 64.0, 0.3,
                                       450.0, 32768)])
    f16 = {r["measure"]: (r["ratio"], r["met"]) for r in rows
           if r["pair"] == "jaxserve gguf f16kv vs llama.cpp gguf"}
    # 64/80 = 0.8 (goal >= 1: no); 0.3/0.4 = 0.75 (yes); 450/500 = 0.9 (yes)
    assert f16["throughput"] == (pytest.approx(0.8), False)
    assert f16["mean TTFT"] == (pytest.approx(0.75), True)
    assert f16["peak RSS"] == (pytest.approx(0.9), True)


# ------------------------------------------------------------ commands and processes
def test_schedule_fresh_per_case_or_one_server_per_n():
    cases = [cmp.parse_case(c) for c in ("16:seed8:burst", "8:seed8:burst", "16:ragged64:burst")]
    fresh = cmp.schedule(cases, ("llama.cpp", "jaxserve"), reuse=False)
    assert [(e, [c.key for c in g]) for e, g in fresh] == [
        ("llama.cpp", ["16:seed8:burst"]), ("jaxserve", ["16:seed8:burst"]),
        ("llama.cpp", ["8:seed8:burst"]), ("jaxserve", ["8:seed8:burst"]),
        ("llama.cpp", ["16:ragged64:burst"]), ("jaxserve", ["16:ragged64:burst"])]
    reused = cmp.schedule(cases, ("jaxserve",), reuse=True)
    assert [(e, [c.key for c in g]) for e, g in reused] == [
        ("jaxserve", ["16:seed8:burst", "16:ragged64:burst"]), ("jaxserve", ["8:seed8:burst"])]


def test_server_commands_give_equal_kv(tmp_path):
    a, cases = cmp.resolve_args(["--case=16:ragged64:arrivals", "--llama_server=/b/llama-server",
                                 "--f32_model=/m/f32.gguf", "--jaxserve_cmd=env X=1 jaxserve serve",
                                 "--jaxserve_extra=--compile_cache_dir=/cc"])
    plan = cmp.plan_kv(11632, 16)
    ll = cmp.server_command("llama.cpp f32kv", a, cases[0].num_seqs, plan, 9001)
    assert ll[:3] == ["/b/llama-server", "-m", "/m/f32.gguf"]
    joined = " ".join(ll)
    for part in ("--host 127.0.0.1", "--port 9001", "--parallel 16", "-kvu", "-c 11776", "-t 2",
                 "-ctk f32", "-ctv f32"):
        assert part in joined, part
    # llama.cpp's defaults: F32 weights, no KV type flag (f16); the original file as shipped
    ll = cmp.server_command("llama.cpp", a, 16, plan, 9001)
    assert ll[2] == "/m/f32.gguf" and "-ctk" not in ll and "-c" in ll
    ll = cmp.server_command("llama.cpp gguf", a, 16, plan, 9001)
    assert ll[2] == str(a.model) and "-ctk" not in ll
    js = cmp.server_command("jaxserve", a, cases[0].num_seqs, plan, 9002)
    assert js[:4] == ["env", "X=1", "jaxserve", "serve"]
    for part in ("--host=127.0.0.1", "--port=9002", "--max_num_seqs=16", "--num_kv_blocks=737",
                 "--block_size=16", "--compile_cache_dir=/cc", "--quantization=none"):
        assert part in js, part
    assert "--quantization=auto" in cmp.server_command("jaxserve gguf", a, 16, plan, 9002)
    # every program built before a case (none compiling in the background during it),
    # unless --jaxserve_extra or --jaxserve_cmd names a --warmup of its own
    assert js.count("--warmup=full") == 1
    for flags in (["--jaxserve_extra=--warmup=progressive"],
                  ["--jaxserve_extra=--warmup", "--jaxserve_extra=progressive"],
                  ["--jaxserve_cmd=jaxserve serve --warmup=progressive"]):
        a, _ = cmp.resolve_args(["--case=16:seed8:burst", *flags])
        js = cmp.server_command("jaxserve", a, 16, plan, 9002)
        assert "--warmup=full" not in js and "progressive" in " ".join(js), flags


def test_a_reused_llama_server_can_erase_its_slots(tmp_path):
    """--reuse_server empties llama.cpp's slots between cases (POST /slots/N?action=erase),
    which llama-server answers 501 unless started with an existing --slot-save-path."""
    base = ["--case=16:ragged64:burst", "--llama_server=/b/llama-server",
            "--f32_model=/m/f32.gguf", f"--out_dir={tmp_path}"]
    plan = cmp.plan_kv(11632, 16)
    a, _ = cmp.resolve_args(base + ["--reuse_server"])
    ll = cmp.server_command("llama.cpp gguf", a, 16, plan, 9001)
    at = ll.index("--slot-save-path")
    assert Path(ll[at + 1]).is_dir() and Path(ll[at + 1]).parent == tmp_path
    for extra in ([], ["--reuse_server", "--warm_cases"]):  # nothing to erase
        a, _ = cmp.resolve_args(base + extra)
        assert "--slot-save-path" not in cmp.server_command("llama.cpp gguf", a, 16, plan, 9001)


def test_load_warning():
    assert cmp.load_warning(0.8, "x") is None
    w = cmp.load_warning(2.5, "jaxserve 16:seed8:burst")
    assert w.startswith("WARNING: load average 2.50 > 1 before jaxserve 16:seed8:burst")


STUB = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    print("stub up", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_start_read_rss_and_stop_by_pid(tmp_path):
    port = servers.free_port()
    proc = servers.start_server([sys.executable, "-c", STUB, str(port)], port, tmp_path / "s.log", 30)
    try:
        assert proc in servers.live_servers()
        rss = servers.parse_proc_status(Path(f"/proc/{proc.pid}/status").read_text())
        assert 1 < rss["VmRSS"] <= rss["VmHWM"] < 1000  # a bare Python: a few MiB to tens of MiB
    finally:
        servers.stop_server(proc)
    assert proc.returncode == -15 and proc not in servers.live_servers()  # ended by our SIGTERM
    assert "stub up" in (tmp_path / "s.log").read_text()


def test_a_server_that_dies_is_reported_with_its_log(tmp_path):
    port = servers.free_port()
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*no model here"):
        servers.start_server([sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                         port, tmp_path / "d.log", 30)
    assert not servers.live_servers()
