"""Run every benchmark and rewrite docs/benchmarks.md from their results.

Each script runs as its own process with ``--json-out bench/results/<name>.json`` (its printed report
goes to ``bench/results/<name>.txt`` and to this terminal); then ``docs/benchmarks.md`` is generated
from every result file there (``bench/_report.py``), together with ``gpu_check.json`` (from
``bench/gpu_check.py`` on a GPU machine) and ``demo.json`` (from ``timeslice demo -o FILE``) when present.
A script that fails is named in the document; the others still count.

Run: ``python bench/run_all.py [--quick] [--only scale,recovery] [--no-run]``. ``--quick`` passes
``--quick`` to every script (a pass of a few minutes); ``--no-run`` only regenerates the document.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import _common as c
import _report

# A result that another script's run writes (the name of the result file, then the script that makes it).
SCRIPT_OF = {"chaos_policies": "chaos"}
SCRIPTS = {name: c.BENCH / f"{SCRIPT_OF.get(name, name)}.py" for name in _report.ORDER}
# Flags a script gets here beyond its defaults: the recorded trace replay also takes the multi-pool profiles through
# the real stack (minutes; by default they are only simulated); the chaos run with the scheduling policies on every
# group, its jobs away between holds (so that groups go idle and the predictive restore plans).
EXTRA_ARGS = {
    "trace_replay": ["--pool-mode", "both"],
    "chaos_policies": [
        *("--seed", "3", "--predict", "--shares", "--quantum-ms", "40", "--min-hold-ms", "10", "--away-ms", "30"),
    ],
}
DOC = c.ROOT / "docs" / "benchmarks.md"


def run_one(name: str, results: Path, quick: bool, timeout: float) -> str | None:
    """Run one bench script; None when it succeeded, else why it did not."""
    out = results / f"{name}.json"
    out.unlink(missing_ok=True)
    args = [
        sys.executable,
        str(SCRIPTS[name]),
        *EXTRA_ARGS.get(name, []),
        "--json-out",
        str(out),
        *(["--quick"] if quick else []),
    ]
    print(f"== {name}: {' '.join(args[1:])}", flush=True)
    t = time.monotonic()
    try:
        proc = subprocess.run(
            args, cwd=c.ROOT, env=c.child_env(), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    (results / f"{name}.txt").write_text(proc.stdout + proc.stderr)
    print(proc.stdout, end="", flush=True)
    print(f"== {name}: exit {proc.returncode} in {time.monotonic() - t:.0f} s", flush=True)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return f"exit {proc.returncode}: {tail}"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="pass --quick to every script")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(SCRIPTS)}")
    p.add_argument("--no-run", action="store_true", help="only regenerate the document from existing results")
    p.add_argument("--results", default=str(c.RESULTS), help="folder of the result files")
    p.add_argument("--doc", default=str(DOC), help="the document to rewrite")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per script")
    a = p.parse_args()
    names = [n.strip() for n in a.only.split(",")] if a.only else list(SCRIPTS)
    unknown = set(names) - set(SCRIPTS)
    if unknown:
        p.error(f"unknown benchmarks: {', '.join(sorted(unknown))}")
    results = Path(a.results)
    results.mkdir(parents=True, exist_ok=True)
    failures: dict[str, str] = {}
    if not a.no_run:
        for name in names:
            why = run_one(name, results, a.quick, a.timeout)
            if why:
                failures[name] = why
                print(f"== {name} FAILED: {why}", file=sys.stderr)
    generator = " ".join(["python bench/run_all.py", *sys.argv[1:]])
    doc = _report.render(_report.load_results(results), generator=generator, quick=a.quick, failures=failures)
    Path(a.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(a.doc).write_text(doc)
    print(f"wrote {a.doc}" + (f"; failed: {', '.join(failures)}" if failures else ""))
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
