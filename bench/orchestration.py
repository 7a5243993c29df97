"""How much of a pipeline run's wall time went to orchestration rather than work.

    source .smolflow/env && python bench/orchestration.py runs/tiny [--flow-run ID]

Wall time is the flow run's, from the Prefect API (the newest completed full-pipeline run unless
an id is given). Work is the time inside task runs (the union of their intervals), gathered over the
run and its subflow runs, less the eval follower: its task spans every training stage, start-ups
between phases and stages included, so counting it would hide them; the rest is orchestration: flow
and subflow start-up, imports, state round trips between tasks. Printed as shares of the wall
time, so the figure holds on a noisy machine. Steps' own timings come from their manifests.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import urllib.request
from datetime import datetime
from pathlib import Path

FOLLOWER = "eval-follow"  # the task name of tasks/evaluate.py follow


def api(path: str, body: dict | None = None):
    url = os.environ.get("PREFECT_API_URL", "http://127.0.0.1:4200/api") + path
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if auth := os.environ.get("PREFECT_API_AUTH_STRING"):  # `make serve`'s server asks for it (.smolflow/env)
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def when(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--flow-run", default=None, help="flow run id [default: the newest completed full-pipeline run]")
    args = parser.parse_args()
    if args.flow_run:
        run = api(f"/flow_runs/{args.flow_run}")
    else:
        runs = api(
            "/flow_runs/filter",
            {
                "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}},
                "flows": {"name": {"any_": ["full-pipeline"]}},
                "sort": "END_TIME_DESC",
                "limit": 1,
            },
        )
        if not runs:
            raise SystemExit("no completed full-pipeline flow run on this server")
        run = runs[0]
    start, end = when(run["start_time"]), when(run["end_time"])
    wall = end - start
    subflows = api("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run["id"]]}}, "limit": 200})
    flow_ids = [run["id"]] + [f["id"] for f in subflows]
    wrappers = {f["parent_task_run_id"] for f in subflows}  # the task run standing for a subflow call
    tasks = []
    for offset in range(0, 5000, 200):
        page = api("/task_runs/filter", {"flow_runs": {"id": {"any_": flow_ids}}, "limit": 200, "offset": offset})
        tasks += page
        if len(page) < 200:
            break
    intervals = sorted(
        (when(t["start_time"]), when(t["end_time"]))
        for t in tasks
        if t["id"] not in wrappers and t["start_time"] and t["end_time"] and not t["name"].startswith(FOLLOWER)
    )
    inside, cursor = 0.0, 0.0
    for a, b in intervals:
        a = max(a, cursor)
        if b > a:
            inside += b - a
            cursor = b
    print(f"flow run {run['name']} ({run['id']}): wall {wall:.0f} s ({wall / 60:.1f} min), attempts {run['run_count']}")
    print(f"queue to start (worker pickup): {start - when(run['expected_start_time']):.0f} s")
    for manifest in sorted(args.run_dir.glob("*/manifest.json"), key=lambda p: json.loads(p.read_text()).get("started", "")):
        m = json.loads(manifest.read_text())
        if start - 1 <= when(m["started"]) <= end:
            print(f"  step {m['name']:24s} {m['seconds']:8.1f} s  {m['seconds'] / wall:6.1%}")
    print(f"inside tasks (work): {inside:.0f} s = {inside / wall:.1%} of wall time ({len(intervals)} task runs)")
    print(f"orchestration (outside every task): {wall - inside:.0f} s = {(wall - inside) / wall:.1%} of wall time")


if __name__ == "__main__":
    main()
