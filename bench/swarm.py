"""Benchmark: one mixture swarm with its proxies trained here, `concurrency` at a time, against the same swarm
with every pretraining phase a Slurm job on a local cluster (`--set @configs/overlays/slurm.yaml`).

Each side runs from nothing (curation included) in its own folder and step store, one after the other on
the same cores, and the figures are printed side by side with Slurm's as a ratio of local's. Both sides
must write the same `report/metrics.csv`: the engine moves where a proxy trains, not what it measures.
As root (the local cluster's daemons run as root). Usage:

    .venv/bin/python bench/swarm.py [--swarm configs/swarms/mix_phase1.yaml] [--proxies N] [--no-validation]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flows.cluster import Slurm, free_port_pair  # noqa: E402

OVERLAY = REPO / "configs" / "overlays" / "slurm.yaml"


def swarm_file(src: Path, dest: Path, proxies: int | None, validation: bool) -> Path:
    """SRC with its base made absolute (the copy lives elsewhere) and the proxies and validation as asked."""
    spec = yaml.safe_load(src.read_text())
    spec["base"] = str((src.parent / spec["base"]).resolve())
    if proxies:
        spec["proxies"] = proxies
    if not validation:
        spec["validation"] = None
    dest.write_text(yaml.safe_dump(spec, sort_keys=False))
    return dest


def walls(root: Path) -> dict[str, float]:
    """Seconds the swarm's own ablations recorded in this invocation (the last of their records): the proxies' (ROOT)
    and the validation's (ROOT/validate)."""
    out = {}
    for name, folder in (("proxies", root), ("validation", root / "validate")):
        if (record := folder / "ablation.json").is_file():
            out[name] = json.loads(record.read_text())["wall_seconds"][-1]
    return out


def run_swarm(spec: Path, root: Path, extra: list[str], log: Path) -> float:
    cmd = [str(Path(sys.executable).with_name("smolflow")), "swarm", str(spec), "--run-dir", str(root)]
    cmd += ["--set", f"storage.store={root / 'steps'}", *(a for x in extra for a in ("--set", x))]
    print(f"  $ smolflow {' '.join(cmd[1:])}  (log: {log})", flush=True)
    started = time.time()
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"the swarm failed ({code}); see {log}")
    return time.time() - started


def most_running(cluster: Slurm, stop: threading.Event, seen: list[int]) -> None:
    """The most pretraining jobs RUNNING at once, from squeue every 2 s."""
    while not stop.wait(2):
        seen.append(sum(1 for j in cluster.jobs() if j["state"] == "RUNNING" and "pretrain_" in j["name"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swarm", type=Path, default=REPO / "configs" / "swarms" / "mix_phase1.yaml")
    parser.add_argument("--proxies", type=int, default=None, help="[default: the swarm file's]")
    parser.add_argument("--no-validation", action="store_true", help="fit and propose only, no runs at the larger scale")
    parser.add_argument("--workdir", type=Path, default=None, help="[default: a new folder under /tmp]")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the local Slurm cluster's daemons run as root")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="smolflow-swarm-bench-"))
    if any((work / side).exists() for side in ("local", "slurm")):  # its steps would be cached: nothing to time
        raise SystemExit(f"{work} holds an earlier run of this bench: give a new --workdir")
    work.mkdir(parents=True, exist_ok=True)
    spec = swarm_file(args.swarm.resolve(), work / "swarm.yaml", args.proxies, not args.no_validation)
    print(f"swarm {args.swarm} ({yaml.safe_load(spec.read_text())['proxies']} proxies) in {work}", flush=True)

    print("local: proxies as processes of this machine", flush=True)
    local = run_swarm(spec, work / "local", [], work / "local.log")

    print("slurm: every pretraining phase (and curation) a job of a local cluster", flush=True)
    cluster = Slurm(state=work / "slurm-cluster", port=free_port_pair())
    cluster.start(timeout_s=180, say=lambda line: None)
    os.environ["SLURM_CONF"] = str(cluster.conf)
    stop, seen = threading.Event(), [0]
    watcher = threading.Thread(target=most_running, args=(cluster, stop, seen), daemon=True)
    watcher.start()
    try:
        slurm = run_swarm(spec, work / "slurm", [f"@{OVERLAY}"], work / "slurm.log")
        left = cluster.jobs()
    finally:
        stop.set()
        watcher.join()
        cluster.stop()

    same = (work / "local" / "report" / "metrics.csv").read_text() == (work / "slurm" / "report" / "metrics.csv").read_text()
    parts = {"local": walls(work / "local"), "slurm": walls(work / "slurm")}
    print("\n| | local | Slurm | Slurm / local |\n|---|---|---|---|")
    print(f"| wall, whole swarm | {local:,.0f} s | {slurm:,.0f} s | {slurm / local:.2f} |")
    for part in parts["local"]:
        a, b = parts["local"][part], parts["slurm"].get(part, float("nan"))
        print(f"| wall, {part} | {a:,.0f} s | {b:,.0f} s | {b / a:.2f} |")
    a, b = local - sum(parts["local"].values()), slurm - sum(parts["slurm"].values())
    print(f"| wall, the rest (curation, fits, report, start-up) | {a:,.0f} s | {b:,.0f} s | {b / a:.2f} |")
    print(f"\nmost pretraining jobs RUNNING at once: {max(seen)}; jobs left in the queue: {len(left)}")
    print(f"metrics.csv {'identical' if same else 'DIFFERS'} between the two (the proxies' targets)")
    if not same or left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
