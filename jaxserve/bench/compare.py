"""`jaxserve bench compare`: jaxserve against llama.cpp's `llama-server`, side by side.

    jaxserve bench compare                      # N = 8 and 16, seed8 + ragged64 (burst, arrivals)
    jaxserve bench compare --profile=short      # one small case, a smoke test of the whole path
    jaxserve bench compare --llama_server=PATH --llama_quantize=PATH   # skip the build
    scripts/bench_vs_llamacpp.sh ...            # the same, from a shell

What it does (issue 11, item 1; the method of `../shared/bench/BASELINES.md`):
1. Builds `llama-server` and `llama-quantize` once into a cache directory, from
   the llama.cpp tree vendored in the `llama-cpp-python` sdist on PyPI (CMake
   Release, `GGML_NATIVE`, no curl/OpenSSL/web UI/tests).
2. Requantizes the GGUF to F32 once (`llama-quantize --allow-requantize`), so
   both engines run the same fp32 weights; jaxserve dequantizes the same file.
3. For every case (N sequences, a trace, burst or arrival times) starts each
   configuration's server in turn (`compare_configs.CONFIGS`: llama.cpp on F32 with
   its default f16 KV, with f32 KV, and on the original file; jaxserve fp32 and with
   the file's quantization kept) on 127.0.0.1 with equal KV capacity in tokens:
   llama.cpp with `--parallel N -kvu -c T -t 2` (one pool shared by all slots, like
   jaxserve's paged pool) and jaxserve with `--max_num_seqs N --num_kv_blocks T/block+1
   --warmup=full` (no program compiling during a case; a --warmup given overrides it).
   T is jaxserve's default pool (or --kv_tokens) rounded up to llama.cpp's 256-token
   context granularity, so both hold exactly T tokens. Each case gets fresh servers: no prefix
   cache carries over between traces and the peak RSS (VmHWM) belongs to that one load.
   With --reuse_server each case still starts cold (jaxserve's and vLLM's POST
   /reset_prefix_cache, llama.cpp's slot erase) unless --warm_cases. Background load
   collapses llama.cpp's threads, so a load average above 1 before a case is printed as
   a WARNING and kept in its record.
4. Drives both with the same `jaxserve bench serve` client (streaming chat, greedy,
   `ignore_eos`, exact `max_tokens`), records `uptime` before and after each run, stops each
   server by PID, prints one table of jaxserve / llama.cpp per `compare_configs.PAIRS`, writes a JSON.

Servers never outlive this process: they are stopped by PID in a `finally`,
SIGTERM/SIGHUP are turned into a normal exit so that `finally` runs, and each
server is started with PR_SET_PDEATHSIG so even a SIGKILL of this process
takes them down.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence


from jaxserve.bench.compare_configs import (  # noqa: F401 (KVPlan, LLAMA_CTX_PAD: re-exported)
    CONFIGS, LLAMA_CTX_PAD, PAIRS, KVPlan, configs_for, gguf_kv_dims, jaxserve_pool_tokens,
    kv_bytes_per_token, plan_kv, server_command)
from jaxserve.bench.servers import (LLAMA_CPP_PYTHON_VERSION, ensure_f32_gguf, ensure_llama_build,
                                    exit_on_signal, free_port, live_servers, start_server,
                                    stop_server, tree_proc_status, uptime)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TRACES_DIR = REPO_ROOT.parent / "shared" / "bench"
DEFAULT_CACHE = Path(os.environ.get("JAXSERVE_LLAMA_CPP_CACHE",
                                    Path.home() / ".cache" / "jaxserve" / "llama.cpp"))
JAXSERVE_KV_MIB = 512  # `jaxserve serve --kv_cache_memory_mb` default
JAXSERVE_BLOCK = 16    # `jaxserve serve --block_size` default
ENGINES = tuple(CONFIGS)  # every configuration (`compare_configs`)
LOAD_WARN = 1.0  # load average above which a case's numbers are not trusted
MODES = ("burst", "arrivals")
PROFILES = {  # N:trace:mode cases
    "full": tuple(f"{n}:{t}" for n in (8, 16)
                  for t in ("seed8:burst", "ragged64:burst", "ragged64:arrivals")),
    # what issue 11 asks first: the whole table at 16, seed8 also at 8 (llama.cpp's best there)
    "issue": ("16:seed8:burst", "16:ragged64:burst", "16:ragged64:arrivals", "8:seed8:burst"),
    "short": ("8:ragged64:burst",),
}
SHORT_NUM_PROMPTS = 16


@dataclass(frozen=True)
class Case:
    """One comparison: `num_seqs` sequences (slots), a trace, `burst` or `arrivals`."""

    num_seqs: int
    trace: str
    mode: str

    @property
    def key(self) -> str:
        return f"{self.num_seqs}:{self.trace}:{self.mode}"


def parse_case(text: str) -> Case:
    """'16:ragged64:arrivals' -> Case(16, 'ragged64', 'arrivals').

    Raises:
      ValueError: not three ':'-separated fields, N < 1, or a mode not in MODES.
    """
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"case {text!r} must be N:TRACE:MODE, e.g. 16:ragged64:burst")
    n, trace, mode = parts
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"case {text!r}: N={n!r} must be an integer >= 1")
    if mode not in MODES:
        raise ValueError(f"case {text!r}: mode {mode!r} must be one of {MODES}")
    if not trace:
        raise ValueError(f"case {text!r}: the trace name is empty")
    return Case(int(n), trace, mode)


def resolve_trace(name: str, traces_dir: Path) -> Path:
    """A trace name ('seed8') -> traces_dir/seed8.jsonl; a path ending .jsonl is used as is.

    Raises:
      FileNotFoundError: the file does not exist.
    """
    path = Path(name) if name.endswith(".jsonl") else Path(traces_dir) / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"trace {name!r}: {path} does not exist")
    return path


# ------------------------------------------------------------ server logs
_JS_KV = re.compile(r"KV cache: (\d+) blocks x (\d+) tokens = (\d+) tokens \(([\d.]+) MiB\)")
_LLAMA_KV = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells")


def parse_kv_log(text: str, engine: str) -> dict[str, float] | None:
    """{'tokens', 'mib'} from a server log's KV line; `engine`: an engine or configuration."""
    engine = getattr(CONFIGS.get(engine), "engine", engine)  # "jaxserve gguf" -> "jaxserve"
    if engine == "jaxserve":
        m = _JS_KV.search(text)
        return {"tokens": int(m.group(3)), "mib": float(m.group(4))} if m else None
    m = _LLAMA_KV.search(text)
    return {"tokens": int(m.group(2)), "mib": float(m.group(1))} if m else None


def run_client(port: int, trace: Path, case: Case, out_json: Path,
               num_prompts: int | None, timeout_s: float) -> dict[str, Any]:
    """`jaxserve bench serve` against 127.0.0.1:port; returns its summary dict."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "bench", "serve",
           f"--base_url=http://127.0.0.1:{port}/v1", f"--trace={trace}", "--endpoint=chat",
           "--temperature=0", "--ignore_eos", f"--timeout_s={timeout_s}", f"--output_json={out_json}"]
    if case.mode == "burst":
        cmd.append("--request_rate=inf")
    if num_prompts:
        cmd.append(f"--num_prompts={num_prompts}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if not out_json.is_file():
        raise RuntimeError(f"bench serve wrote no {out_json} (exit {r.returncode}): {r.stderr[-1500:]}")
    return json.loads(out_json.read_text())["summary"]


@dataclass
class Running:
    """A started server: its engine, process, port, log and how many traces it has served."""

    engine: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    cmd: list[str]
    start_s: float
    runs: int = 0


def launch(engine: str, case: Case, args: argparse.Namespace, plan: KVPlan) -> Running:
    """Start `engine`'s server for `case` (its N) and wait until it is healthy."""
    port = free_port()
    log_path = args.out_dir / f"{_tag(engine)}-{case.key.replace(':', '-')}.log"
    cmd = server_command(engine, args, case.num_seqs, plan, port)
    t0 = time.monotonic()
    proc = start_server(cmd, port, log_path, args.start_timeout_s,
                        cwd=args.jaxserve_cwd if CONFIGS[engine].engine == "jaxserve" else None)
    return Running(engine, proc, port, log_path, cmd, time.monotonic() - t0)


def _tag(name: str) -> str:
    return name.replace(" ", "_").replace(".", "")


def make_cold(srv: Running, num_seqs: int) -> None:
    """Empty a reused server's prefix cache before its next case: jaxserve's POST
    /reset_prefix_cache, llama.cpp's POST /slots/{id}?action=erase for every slot."""
    import httpx

    base = f"http://127.0.0.1:{srv.port}"
    paths = (["/reset_prefix_cache"] if CONFIGS[srv.engine].engine == "jaxserve" else
             [f"/slots/{i}?action=erase" for i in range(num_seqs)])
    for path in paths:
        r = httpx.post(base + path, timeout=30)
        if r.status_code != 200:
            raise RuntimeError(f"{srv.engine}: POST {path} -> {r.status_code} {r.text[:200]}")


def load_warning(load1: float, what: str) -> str | None:
    """The WARNING line for a 1-minute load average above LOAD_WARN (None if quiet)."""
    if load1 <= LOAD_WARN:
        return None
    return (f"WARNING: load average {load1:.2f} > {LOAD_WARN:g} before {what}: other processes "
            "share the CPU and llama.cpp's threads collapse under them; not a clean number")


def drive(srv: Running, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Drive one trace through a running server; return the record (RSS read right after)."""
    tag = f"{_tag(srv.engine)}-{case.key.replace(':', '-')}"
    if srv.runs and not args.warm_cases:
        make_cold(srv, case.num_seqs)
    warn = load_warning(os.getloadavg()[0], f"{srv.engine} {case.key}")
    if warn:
        print("  " + warn, flush=True)
    load_before = uptime()
    s = run_client(srv.port, resolve_trace(case.trace, args.traces_dir), case,
                   args.out_dir / f"{tag}.json", args.num_prompts, args.request_timeout_s)
    load_after = uptime()
    rss = tree_proc_status(srv.proc.pid)  # with its engine process, if any
    srv.runs += 1
    kv = parse_kv_log(srv.log_path.read_text(errors="replace"), srv.engine)
    if kv is None and CONFIGS[srv.engine].engine == "llama.cpp":
        # llama-server at its default verbosity does not print llama_kv_cache's size line;
        # with -kvu it allocates exactly n_ctx = -c cells (the log's "n_ctx_slot" is per slot).
        kv = {"tokens": args.kv_plan.llama_ctx, "source": "computed from -c",
              "mib": args.kv_plan.llama_ctx * args.kv_bytes_per_token
              * CONFIGS[srv.engine].kv_bytes / 4 / 2**20}
    kv = kv or {}
    rec = {"case": case.key, "engine": srv.engine, "tok_s": s["output_throughput"],
           "ttft_mean_s": s["ttft_ms"]["mean"] / 1e3, "peak_rss_mib": rss.get("VmHWM"),
           "rss_after_mib": rss.get("VmRSS"), "kv_tokens": kv.get("tokens"), "kv_mib": kv.get("mib"),
           "kv_source": kv.get("source", "server log"), "completed": s["completed"], "failed": s["failed"], "output_tokens": s["total_output_tokens"],
           "expected_tokens": s["expected_output_tokens"], "duration_s": s["duration_s"],
           "start_s": srv.start_s, "runs_on_server": srv.runs, "uptime_before": load_before,
           "uptime_after": load_after, "load_warning": warn, "errors": s["errors"], "command": shlex.join(srv.cmd),
           "log": str(srv.log_path)}
    print(f"  {srv.engine:<15} {case.key:<22} {rec['tok_s']:7.1f} tok/s  TTFT {rec['ttft_mean_s']:6.2f} s"
          f"  peak RSS {rec['peak_rss_mib'] or float('nan'):6.0f} MiB  KV {rec['kv_tokens']} tok"
          f"  {rec['completed']}/{rec['completed'] + rec['failed']} ok  [{load_after}]", flush=True)
    return rec


def schedule(cases: Sequence[Case], engines: Sequence[str], reuse: bool) -> list[tuple[str, list[Case]]]:
    """(engine, the cases one server serves) in run order.

    Default: a fresh server per case, engines back to back per case (each pair
    sees about the same machine load). `reuse`: one server per (N, engine),
    serving that N's cases in order; N values keep their first-seen order.
    """
    if not reuse:
        return [(e, [c]) for c in cases for e in engines]
    by_n: dict[int, list[Case]] = {}
    for c in cases:
        by_n.setdefault(c.num_seqs, []).append(c)
    return [(e, group) for group in by_n.values() for e in engines]


# ------------------------------------------------------------ the table
# (measure, record field, unit, goal of the jaxserve/llama.cpp ratio: "≥1" or "≤1")
MEASURES = (("throughput", "tok_s", "tok/s", "≥1"), ("mean TTFT", "ttft_mean_s", "s", "≤1"),
            ("peak RSS", "peak_rss_mib", "MiB", "≤1"), ("KV capacity", "kv_tokens", "tokens", "=1"))


def ratio_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (case, pair, measure) with both configurations' values and jaxserve's /
    llama.cpp's, for each `compare_configs.PAIRS` pair with at least one of them measured
    (an opt-in configuration's pairs only where it ran).

    Cases keep the order they first appear in; a pair missing a configuration (a
    one-engine run) gets None for the missing value and the ratio.
    """
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_case.setdefault(r["case"], {})[r["engine"]] = r
    rows = []
    for case, cfgs in by_case.items():
        for js_cfg, ll_cfg in PAIRS:
            if (js_cfg not in cfgs and ll_cfg not in cfgs) or any(
                    not CONFIGS[c].default and c not in cfgs for c in (js_cfg, ll_cfg)):
                continue  # nothing measured, or an opt-in configuration that did not run
            for name, field, unit, goal in MEASURES:
                ll = (cfgs.get(ll_cfg) or {}).get(field)
                js = (cfgs.get(js_cfg) or {}).get(field)
                ratio = js / ll if ll and js is not None else None
                met = None
                if ratio is not None:
                    met = {"≥1": ratio >= 1, "≤1": ratio <= 1, "=1": abs(ratio - 1) < 1e-9}[goal]
                rows.append({"case": case, "pair": f"{js_cfg} vs {ll_cfg}", "measure": name,
                             "unit": unit, "llama.cpp": ll, "jaxserve": js, "ratio": ratio,
                             "goal": goal, "met": met})
    return rows


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.2f}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: | case | configurations | measure | llama.cpp | jaxserve | ratio | goal met |."""
    out = ["| case (N:trace:mode) | jaxserve vs llama.cpp | measure | llama.cpp | jaxserve | "
           "jaxserve / llama.cpp | goal |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "–" if r["met"] is None else ("yes" if r["met"] else "no")
        out.append(f"| {r['case']} | {r['pair']} | {r['measure']} ({r['unit']}) | "
                   f"{_fmt(r['llama.cpp'])} | {_fmt(r['jaxserve'])} | {_fmt(r['ratio'])} | "
                   f"{r['goal']} {met} |")
    return "\n".join(out)


# ------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="full",
                   help="full: N=8,16 x 3 runs; issue: 3 runs at 16 + seed8 at 8; short: smoke test")
    p.add_argument("--case", action="append", default=None, metavar="N:TRACE:MODE",
                   help="a case instead of the profile's (repeatable), e.g. 16:ragged64:arrivals")
    p.add_argument("--engines", choices=("both", "llama.cpp", "jaxserve"), default="both",
                   help="these engines' default configurations (compare_configs.CONFIGS)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated configurations instead (of: {', '.join(CONFIGS)}; "
                        "'gguf': the original file, else its F32 requantization; 'f16kv' "
                        "(opt-in): --kv_cache_dtype=float16; 'f32kv': llama.cpp -ctk/-ctv f32)")
    p.add_argument("--reuse_server", action="store_true",
                   help="one server per (N, engine) for all its cases, saving start-ups; later "
                        "cases still start cold (prefix cache emptied) unless --warm_cases; peak "
                        "RSS covers all runs so far")
    p.add_argument("--warm_cases", action="store_true",
                   help="with --reuse_server: keep the prefix cache between a server's cases")
    p.add_argument("--num_prompts", type=int, default=None,
                   help="first K requests of each trace (default: all; 16 under --profile=short)")
    p.add_argument("--traces_dir", type=Path, default=DEFAULT_TRACES_DIR)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF both engines load")
    p.add_argument("--cache_dir", type=Path, default=DEFAULT_CACHE,
                   help="llama.cpp source, build and F32 model ($JAXSERVE_LLAMA_CPP_CACHE)")
    p.add_argument("--llama_cpp_python_version", default=LLAMA_CPP_PYTHON_VERSION)
    p.add_argument("--build_jobs", type=int, default=2)
    p.add_argument("--llama_server", type=Path, default=None, help="use this binary; skip the build")
    p.add_argument("--llama_quantize", type=Path, default=None,
                   help="with --llama_server: the quantizer (else looked up beside it)")
    p.add_argument("--f32_model", type=Path, default=None, help="an F32 GGUF; skip requantizing")
    p.add_argument("--jaxserve_cmd", default=None,
                   help="how to start jaxserve, exec'ing the server (default: `jaxserve serve`); "
                        "another tree: `env PYTHONPATH=<tree> python -P -m jaxserve.cli serve`")
    p.add_argument("--jaxserve_extra", action="append", default=[], metavar="--FLAG=V",
                   help="extra flag for jaxserve serve (repeatable)")
    p.add_argument("--jaxserve_cwd", type=Path, default=None)
    p.add_argument("--kv_cache_mib", type=int, default=None,
                   help="jaxserve's pool whose token count both engines get (rounded up to 256; "
                        f"default {JAXSERVE_KV_MIB})")
    p.add_argument("--kv_tokens", type=int, default=None,
                   help="both engines' KV capacity in tokens instead of --kv_cache_mib's "
                        "(rounded up to 256), e.g. 32768 = 16 slots x 2048")
    p.add_argument("--block_size", type=int, default=JAXSERVE_BLOCK)
    p.add_argument("--start_timeout_s", type=float, default=3600.0,
                   help="a cold start compiles every bucket program: minutes on a loaded machine")
    p.add_argument("--request_timeout_s", type=float, default=1800.0)
    p.add_argument("--out_dir", type=Path, default=None,
                   help="logs and per-run JSON (default: CACHE/../compare/<UTC time>)")
    p.add_argument("--output_json", type=Path, default=None, help="default: OUT_DIR/compare.json")
    return p


def resolve_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[Case]]:
    """Parse and check the flags; fill the defaults that depend on others. Raises ValueError."""
    a = build_parser().parse_args(list(argv) if argv is not None else None)
    cases = [parse_case(c) for c in (a.case or PROFILES[a.profile])]
    if a.num_prompts is None and a.profile == "short" and not a.case:
        a.num_prompts = SHORT_NUM_PROMPTS
    if a.num_prompts is not None and a.num_prompts < 1:
        raise ValueError(f"--num_prompts={a.num_prompts} must be >= 1")
    if a.kv_tokens is not None and a.kv_tokens < 1:
        raise ValueError(f"--kv_tokens={a.kv_tokens} must be >= 1")
    if a.kv_tokens is not None and a.kv_cache_mib is not None:
        raise ValueError(f"--kv_tokens={a.kv_tokens} and --kv_cache_mib={a.kv_cache_mib} both "
                         "set the KV capacity; give one")
    a.kv_cache_mib = JAXSERVE_KV_MIB if a.kv_cache_mib is None else a.kv_cache_mib
    if a.llama_quantize is not None and a.llama_server is None:
        raise ValueError("--llama_quantize needs --llama_server")
    if a.llama_server is not None and a.llama_quantize is None:
        a.llama_quantize = a.llama_server.parent / "llama-quantize"
    if a.jaxserve_cmd is None:
        exe = Path(sys.executable).parent / "jaxserve"
        a.jaxserve_cmd = f"{exe} serve" if exe.is_file() else f"{sys.executable} -m jaxserve.cli serve"
    a.engines = configs_for(tuple(c.strip() for c in a.configs.split(",")) if a.configs
                            else a.engines)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    a.out_dir = a.out_dir or a.cache_dir.parent / "compare" / stamp
    a.output_json = a.output_json or a.out_dir / "compare.json"
    return a, cases


def capacity_tokens(a: argparse.Namespace) -> int:
    """KV tokens both engines get before llama.cpp's rounding: --kv_tokens, else what
    jaxserve's --kv_cache_mib pool holds at `a.kv_bytes_per_token` (f32 K and V)."""
    return a.kv_tokens or jaxserve_pool_tokens(a.kv_cache_mib, a.block_size, a.kv_bytes_per_token)


def prepare_llama(a: argparse.Namespace) -> None:
    """Fill a.llama_server and a.f32_model: build and requantize unless given (or unused)."""
    if a.llama_server is None:
        bins = ensure_llama_build(a.cache_dir, a.llama_cpp_python_version, a.build_jobs)
        a.llama_server, a.llama_quantize = bins["llama-server"], bins["llama-quantize"]
    f32 = any(CONFIGS[c].weights == "f32" for c in a.engines if CONFIGS[c].engine == "llama.cpp")
    for path in (a.llama_server, (a.f32_model or a.llama_quantize) if f32 else a.model):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist")
    if f32:
        a.f32_model = a.f32_model or ensure_f32_gguf(a.llama_quantize, a.model, a.cache_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry (argv: the arguments after `bench compare`). Returns 0, or 1 if any request failed."""
    try:
        a, cases = resolve_args(argv)
        for c in cases:  # fail before any build or server start
            resolve_trace(c.trace, a.traces_dir)
        if any(CONFIGS[c].engine == "llama.cpp" for c in a.engines):
            prepare_llama(a)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.out_dir.mkdir(parents=True, exist_ok=True)
    a.kv_bytes_per_token = kv_bytes_per_token(*gguf_kv_dims(a.model))
    pool = capacity_tokens(a)
    a.kv_plan = plan = plan_kv(pool, a.block_size)
    print(f"KV: {f'--kv_tokens={pool}' if a.kv_tokens else f'jaxserve pool {a.kv_cache_mib} MiB'}"
          f" = {pool} tokens; both engines get "
          f"{plan.tokens} (llama.cpp -c {plan.llama_ctx} -kvu, jaxserve --num_kv_blocks "
          f"{plan.jaxserve_num_kv_blocks}); out: {a.out_dir}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)
    records: list[dict[str, Any]] = []
    doc = {"argv": list(sys.argv), "plan": asdict(plan), "uptime_start": uptime(), "records": records}
    try:
        for engine, group in schedule(cases, a.engines, a.reuse_server):
            srv = launch(engine, group[0], a, plan)
            try:
                for case in group:
                    records.append(drive(srv, case, a))
                    a.output_json.write_text(json.dumps(doc, indent=1, default=str))  # keep partials
            finally:
                stop_server(srv.proc)
    finally:  # also on SIGTERM/SIGHUP/Ctrl-C: stop the servers, keep and print what was measured
        for proc in live_servers():
            stop_server(proc)
        doc["uptime_end"] = uptime()
        doc["table"] = ratio_rows(records)
        a.output_json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"\nload at start: {doc['uptime_start']}\nload at end:   {doc['uptime_end']}\n")
        print(format_table(doc["table"]))
        print(f"\nwrote {a.output_json}", flush=True)
    return 0 if all(r["failed"] == 0 and r["output_tokens"] == r["expected_tokens"]
                    for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
