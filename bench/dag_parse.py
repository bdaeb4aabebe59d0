"""What parsing the pipelines' DAG files costs (issue 48), beside the code of another commit.

For N specs (copies of `dags/pipelines/clicks_per_user.yaml`), each parse
in a new process, as Airflow makes one per parse:

* the dag-processor's parse of `dags/microbatch_pipelines.py` (every DAG)
  and of `dags/microbatch_spec_errors.py` (the specs' errors), the first
  time (nothing kept: `spec_cache`) and again with no file changed;
* a task's parse of the first file (Airflow's parsing context names one DAG).

A dag-processor parses in a process forked from one that froze its objects
for the garbage collector (`gc.freeze`, against copy-on-write): the
dag-processor's cases freeze what Airflow's import made before the DAG
file's modules are imported, as there; a task's parse freezes nothing.

CPU seconds of the parse alone: the imports of Airflow's SDK and ours come
first and are reported apart. The anchor is the same parses by the code of
`--anchor` (default: the commit before issue 48's second round), checked out
beside this tree, on the same specs, interleaved, `--repeat` times each;
medians. Results: docs/fleet.md, "A task's parse and the dag-processor's".

    .venv/bin/python bench/dag_parse.py [--sizes 200,1000] [--anchor e759f5e]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from doc_sections import replace_section  # noqa: E402
from worktrees import checked_out  # noqa: E402

DOC = ROOT / "docs" / "fleet.md"
SECTION = "### Measured: `bench/dag_parse.py`"

_PARSE = """
import gc, json, os, sys, time
tree, dag_file = sys.argv[1:]
sys.path[:0] = [tree, tree + "/plugins"]
started = time.process_time()
from airflow.dag_processing.dagbag import DagBag
if os.environ.get("BENCH_FROZEN") == "1":
    gc.freeze()  # as Airflow's dag-processor before it forks a parse: its objects frozen, the DAG file's not
import microbatch_airflow.dag_factory
imported = time.process_time()
bag = DagBag(dag_folder=dag_file)
print(json.dumps({"imports": imported - started, "parse": time.process_time() - imported,
                  "dags": len(bag.dag_ids), "errors": len(bag.import_errors)}))
"""


def make_specs(folder: Path, n: int) -> None:
    text = (ROOT / "dags" / "pipelines" / "clicks_per_user.yaml").read_text()
    folder.mkdir(parents=True)
    (folder / "landing").mkdir()
    for i in range(n):
        spec = re.sub(r"(?m)^name: .*$", f"name: p{i:04d}", text)
        spec = re.sub(r"(?m)^checkpoint: .*$", f"checkpoint: lake/_checkpoints/p{i:04d}", spec)
        (folder / f"p{i:04d}.yaml").write_text(spec)


def parse(tree: Path, dag_file: str, folder: Path, cache: Path, dag_id: str | None) -> dict[str, Any]:
    env = {**os.environ, "MICROBATCH_PIPELINES_DIR": str(folder), "MICROBATCH_CACHE_DIR": str(cache),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "PYTHONPATH": "",
           # A busy machine must not turn a slow parse into an import error (30 s by default).
           "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "600"}
    env.pop("_AIRFLOW_PARSING_CONTEXT_DAG_ID", None)
    env["BENCH_FROZEN"] = "1" if dag_id is None else "0"  # the dag-processor's parses: see the module's docstring
    if dag_id is not None:
        env["_AIRFLOW_PARSING_CONTEXT_DAG_ID"] = dag_id
    out = subprocess.run([sys.executable, "-c", _PARSE, str(tree), str(tree / "dags" / dag_file)],
                         env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(trees: dict[str, Path], n: int, work: Path, repeat: int) -> dict[str, dict[str, float]]:
    folder = work / f"specs-{n}"
    make_specs(folder, n)
    samples: dict[str, dict[str, list[float]]] = {label: {} for label in trees}
    for _ in range(repeat):
        for label, tree in trees.items():
            cache = Path(tempfile.mkdtemp(dir=work))
            seen = samples[label]
            for case, dag_file, dag_id in [
                ("dag-processor, first", "microbatch_pipelines.py", None),
                ("dag-processor, again", "microbatch_pipelines.py", None),
                ("errors file, again", "microbatch_spec_errors.py", None),
                ("a task", "microbatch_pipelines.py", "p0001"),
            ]:
                result = parse(tree, dag_file, folder, cache, dag_id)
                assert result["dags"] == (n if dag_id is None and dag_file == "microbatch_pipelines.py" else 1 if dag_id else 0), result
                seen.setdefault(case, []).append(result["parse"])
                seen.setdefault("imports", []).append(result["imports"])
            shutil.rmtree(cache)
    return {label: {case: statistics.median(v) for case, v in cases.items()} for label, cases in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200,1000")
    parser.add_argument("--anchor", default="e759f5e", help="the commit to compare with")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="microbatch-dag-parse-"))
    try:
        with checked_out(args.anchor, work / "anchor") as anchor:
            rows = {}
            for n in [int(s) for s in args.sizes.split(",")]:
                rows[n] = measure({"anchor": anchor, "now": ROOT}, n, work, args.repeat)
                print(json.dumps({"specs": n, **rows[n]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_doc(args, rows)


def write_doc(args: argparse.Namespace, rows: dict[int, dict[str, dict[str, float]]]) -> None:
    lines = [
        SECTION,
        "",
        f"{date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores: CPU seconds of one parse in a new "
        f"process (medians of {args.repeat}, interleaved), the imports apart; the dag-processor's with Airflow's objects "
        f"frozen first, as its forked parses have them; the anchor is commit `{args.anchor}`, "
        "on the same specs (copies of `dags/pipelines/clicks_per_user.yaml`).",
        "",
        "| specs | parse | anchor | now | now / anchor |",
        "|---|---|---|---|---|",
    ]
    for n, row in rows.items():
        for case in ["dag-processor, first", "dag-processor, again", "errors file, again", "a task"]:
            before, after = row["anchor"][case], row["now"][case]
            lines.append(f"| {n:,} | {case} | {before:.3f} s | {after:.3f} s | **{after / before:.2f}** |")
        lines.append(f"| {n:,} | imports (either file) | {row['anchor']['imports']:.2f} s | {row['now']['imports']:.2f} s | |")
    lines.append("")
    replace_section(DOC, SECTION, lines)


if __name__ == "__main__":
    main()
