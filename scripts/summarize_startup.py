"""One table row per `scripts/measure_startup.py` JSON line (stdin or files).

    .venv/bin/python scripts/summarize_startup.py /tmp/jaxserve_startup/serve.jsonl
"""

import fileinput
import json


def main() -> None:
    print("| run | params | healthy s | first token s | first token after params ready s "
          "| all programs ready s | ready with | load (start / end) |")
    print("|---|---|---|---|---|---|---|---|")
    for line in fileinput.input():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        load = lambda k: d.get(k, "").split("load average:")[-1].split(",")[0].strip()  # noqa: E731
        ready = next((w.split("ready with ")[1].split(" programs")[0]
                      for w in d.get("warmup_lines", []) if "ready with" in w), "all")
        pl = d.get("params_line", "")
        params = (("convert " if pl.startswith("converted") else "restore ")
                  + pl.rsplit(" in ", 1)[-1]) if " in " in pl else pl
        print(f"| {d['label']} | {params} | {d.get('healthy_s', 0):.1f} | "
              f"{d.get('first_token_s', 0):.1f} | {d.get('first_token_after_params_s', 0):.1f} | "
              f"{d.get('all_programs_s', d.get('healthy_s', 0)):.1f} | {ready} | "
              f"{load('uptime_start')} / {load('uptime_end')} |")


if __name__ == "__main__":
    main()
