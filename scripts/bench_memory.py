"""Decode speed of a model larger than the memory it may use: a memory cgroup around each run.

    sudo python scripts/bench_memory.py MODEL.colibri --limits 2GiB,1.5GiB --threads 2
    sudo python scripts/bench_memory.py --configs llama.cpp-mmap --llama-gguf M.gguf --llama-bin BIN

For every memory limit, each configuration runs in a fresh process inside a cgroup v1 memory
group (/sys/fs/cgroup/memory/colibri-bench-<pid>, memory.limit_in_bytes = the limit; the page
cache the process causes is charged to it), after `sync; echo 3 > /proc/sys/vm/drop_caches`:

    page-cache      no budget: the kernel's page cache decides what stays (plain mmap)
    budget          --memory-budget (limit - --margin), arena, no prefetch
    budget+prefetch the same with --prefetch (default: router)
    madvise+prefetch the budget in madvise mode (the mapping, WILLNEED/DONTNEED) with prefetch
    llama.cpp-mmap  with --llama-gguf (the same weights as a GGUF) and --llama-bin (the folder
                    of a built llama-bench): `llama-bench -p 0 -n N -r R -t T --repack 0 -lm
                    mmap -o json`, llama.cpp reading its weights from the mapping without
                    repacking them into anonymous memory (what lets it run under a limit)
    llama.cpp       llama-bench's defaults (repacked weights: anonymous memory, no mapping)

Each colibri run is `colibri bench -p 0 -n N -r R --telemetry -o json` (one untimed warm-up, then R
timed repetitions of N decode steps from an empty cache); the script prints one markdown row
per run with tokens/s, hit rate, MB read per token, major faults per token, the cgroup's peak
usage and the 1-minute load average (uptime) when the run started. For llama.cpp the major
faults per token are the cgroup's (memory.stat pgmajfault) over every token it generated,
its warm-up included; it reports no hit rate or bytes read. A run is bounded by
--timeout seconds. Needs root (cgroup, drop_caches); Linux with cgroup v1 memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from colibri.commands.common import byte_size

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
LLAMA_CONFIGS = {
    "llama.cpp-mmap": ["--repack", "0", "-lm", "mmap"],
    "llama.cpp": [],
}
CONFIGS = {
    "page-cache": [],
    "budget": ["--memory-budget", "{budget}"],
    "budget+prefetch": ["--memory-budget", "{budget}", "--prefetch", "{prefetch}"],
    "madvise+prefetch": ["--memory-budget", "{budget}", "--prefetch", "{prefetch}",
                         "--cache-mode", "madvise"],
}


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_limited(cmd: list[str], limit: int, timeout: float
                ) -> tuple[dict | None, int, str, int]:
    """Run cmd in a new memory cgroup of `limit` bytes -> (its JSON output or None, the
    group's peak usage in bytes, stderr's tail, the group's major page faults)."""
    group = CGROUP_ROOT / f"colibri-bench-{os.getpid()}"
    group.mkdir(exist_ok=True)
    try:
        (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (group / "memory.max_usage_in_bytes").write_text("0\n")
        # the child joins the group before it execs Python: everything it maps is charged
        wrapped = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]
        try:
            p = subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout)
            out, err, code = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, err, code = "", f"timed out after {timeout:.0f} s {e.stderr or ''}", -1
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        failcnt = int((group / "memory.failcnt").read_text())
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        majflt = int(stat.get("total_pgmajfault", stat.get("pgmajfault", 0)))
        result = None
        if code < 0 and code != -1:          # killed: say by which signal (the OOM killer: 9)
            err = f"killed by signal {-code}; {err}"
        elif code > 0:
            err = f"exit status {code}; {err}"
        if code == 0:
            result = json.loads(out)
        return result, peak, (err.strip().splitlines() or [""])[-1] + (
            f" (failcnt {failcnt})" if failcnt else ""), majflt
    finally:
        for _ in range(50):                 # the group empties when the child is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="the .colibri file (not needed when --configs "
                    "names only llama.cpp configs)")
    ap.add_argument("--limits", default="2GiB,1.5GiB")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--margin", type=byte_size, default=byte_size("200MiB"),
                    help="limit - budget: the interpreter, the KV cache, the embedding rows")
    ap.add_argument("--prefetch", default="router")
    ap.add_argument("--mlock", action="store_true", help="--mlock in the budget configs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", metavar="OUT", help="also write every run's record here")
    ap.add_argument("--llama-gguf", metavar="GGUF", help="the same weights as a GGUF: adds the "
                    "llama.cpp configs (--configs names them like the others)")
    ap.add_argument("--llama-bin", metavar="DIR", help="folder of a built llama-bench")
    args = ap.parse_args()
    configs = args.configs.split(",")
    if args.llama_gguf:
        if not args.llama_bin or not (Path(args.llama_bin) / "llama-bench").is_file():
            ap.error("--llama-gguf needs --llama-bin DIR with a built llama-bench")
        if args.configs == ap.get_default("configs"):
            configs += list(LLAMA_CONFIGS)
    bad = [c for c in configs if c not in CONFIGS and c not in LLAMA_CONFIGS]
    if bad or (any(c in LLAMA_CONFIGS for c in configs) and not args.llama_gguf):
        ap.error(f"--configs: unknown {bad} or llama.cpp configs without --llama-gguf; "
                 f"expected names from {', '.join([*CONFIGS, *LLAMA_CONFIGS])}")
    if args.model is None and any(c in CONFIGS for c in configs):
        ap.error(f"the colibri configs ({', '.join(c for c in configs if c in CONFIGS)}) need "
                 f"the MODEL argument")
    records = []
    print("| limit | config | t/s | hit rate | MB read/token | major faults/token | "
          "cgroup peak | load (1 min) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for limit_text in args.limits.split(","):
        limit = byte_size(limit_text)
        budget = limit - args.margin
        for config in configs:
            llama = config in LLAMA_CONFIGS
            if llama:
                extra = []
                cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", args.llama_gguf, "-p",
                       "0", "-n", str(args.n_gen), "-r", str(args.repetitions), "-t",
                       str(args.threads), "-o", "json", *LLAMA_CONFIGS[config]]
            else:
                extra = [a.format(budget=budget, prefetch=args.prefetch)
                         for a in CONFIGS[config]]
                if extra and args.mlock:
                    extra.append("--mlock")
                cmd = [sys.executable, "-m", "colibri", "bench", args.model, "-p", "0", "-n",
                       str(args.n_gen), "-r", str(args.repetitions), "-t", str(args.threads),
                       "--bw-mib", "0", "--telemetry", "-o", "json", *extra]
            drop_caches()
            load = os.getloadavg()[0]
            result, peak, err, majflt = run_limited(cmd, limit, args.timeout)
            rec = {"limit": limit_text, "config": config, "budget": budget if extra else None,
                   "load_average": load, "cgroup_peak": peak, "command": " ".join(cmd)}
            if result and llama:
                row = result[0]
                rec.update(tps=row["avg_ts"], stddev=row["stddev_ts"],
                           major_faults=majflt / ((args.repetitions + 1) * args.n_gen))
                print(f"| {limit_text} | {config} | {rec['tps']:.2f} ± {rec['stddev']:.2f} | "
                      f"– | – | {rec['major_faults']:.0f} | {peak / 2**30:.2f} GiB | "
                      f"{load:.2f} |", flush=True)
            elif result:
                row = result[0]
                tel = row.get("telemetry") or {}
                rec.update(tps=row["avg_ts"], stddev=row["stddev_ts"],
                           hit_rate=tel.get("hit_rate"),
                           mb_per_token=tel.get("bytes_read_per_token", 0) / 1e6,
                           major_faults=row["major_faults_per_token"])
                print(f"| {limit_text} | {config} | {rec['tps']:.2f} ± {rec['stddev']:.2f} | "
                      f"{100 * (rec['hit_rate'] or 0):.1f}% | {rec['mb_per_token']:.1f} | "
                      f"{rec['major_faults']:.0f} | {peak / 2**30:.2f} GiB | {load:.2f} |",
                      flush=True)
            else:
                rec["error"] = err
                print(f"| {limit_text} | {config} | failed: {err} | | | | "
                      f"{peak / 2**30:.2f} GiB | {load:.2f} |", flush=True)
            records.append(rec)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
