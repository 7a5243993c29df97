"""Failure drills on a micro recipe: kill the pipeline at random moments, cut S3 during uploads.

    python bench/drills.py --kills 3 --seed 0

1. Reference: the pipeline (curate -> pretrain -> SFT -> evaluate) runs once, uninterrupted.
2. Kill drill: the same pipeline in a fresh run dir is SIGKILLed N times at random moments (either
   the whole flow process group, or only the deepest child: a trainer or a datatrove worker) and
   restarted each time. Afterwards: it completed, every kept checkpoint is complete, no step lock
   is left, and final metrics (loss per stage, SFT loss, every evaluation) equal the reference's.
3. S3 drill: pretraining mirrors to a moto S3 server reached through a TCP proxy; the proxy is cut
   for a few seconds at random moments while checkpoints upload, then restored. Afterwards every
   step and checkpoint is on S3 with its marker, and no upload was given up.

Prints one line per event and a summary table; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


SMOLFLOW = str(Path(sys.executable).with_name("smolflow"))
MICRO = REPO / "configs" / "micro.yaml"
QUICK = ["postrain.sft.max_steps=20", "postrain.sft.weak_checkpoint_step=5", "postrain.data.generated=300", "postrain.data.heldout=20"]


def start_pipeline(recipe: Path, run_dir: Path, log_path: Path, extra: list[str] = ()) -> subprocess.Popen:
    command = [SMOLFLOW, "run", str(recipe), "--run-dir", str(run_dir), "--until", "sft"]
    for item in QUICK + list(extra):
        command += ["--set", item]
    log = open(log_path, "ab")
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def final_metrics(run_dir: Path) -> dict:
    """What must not depend on interruptions: per-stage losses, the SFT loss curve, every eval result."""
    out = {}
    for manifest in sorted(run_dir.glob("pretrain_*/manifest.json")):
        summary = json.loads(manifest.read_text())["summary"]
        out[manifest.parent.name] = round(summary["final_loss"], 5)
    sft = json.loads((run_dir / "sft" / "manifest.json").read_text())["summary"]
    out["sft_loss"] = [[step, round(loss, 4)] for step, loss in sft["loss"]]
    out["sft_accuracy"] = sft["eval"]["accuracy"]
    for record in sorted((run_dir / "evals" / "results").glob("*.json")):
        data = json.loads(record.read_text())
        for task, entry in data["tasks"].items():
            for metric, value in entry["metrics"].items():
                out[f"eval {data['model']['label']} {task} {metric}"] = round(value, 4)
    return out


def integrity(run_dir: Path) -> list[str]:
    """Problems left on disk: incomplete kept checkpoints, stale locks, a `latest` naming nothing."""
    from model.checkpoint import LATEST, is_complete

    problems = []
    for root in run_dir.glob("pretrain_*/checkpoints"):
        for folder in root.glob("step*"):
            if not is_complete(folder):
                problems.append(f"incomplete checkpoint {folder}")
        latest = root / LATEST
        if latest.exists() and not is_complete(root / json.loads(latest.read_text())["tag"]):
            problems.append(f"{latest} names a missing checkpoint")
    problems += [f"lock left behind: {p}" for p in (run_dir / ".partial").glob("*.lock")]
    return problems


def compare(reference: dict, drilled: dict, rel: float = 1e-4) -> list[str]:
    diffs = []
    for key in sorted(set(reference) | set(drilled)):
        a, b = reference.get(key), drilled.get(key)
        if isinstance(a, float) and isinstance(b, float):
            if abs(a - b) > rel * max(1.0, abs(a)):
                diffs.append(f"{key}: {a} vs {b}")
        elif a != b:
            diffs.append(f"{key}: {a} vs {b}")
    return diffs


def kill_somewhere(proc: subprocess.Popen, rng: random.Random) -> str:
    """SIGKILL the whole process group, or only its deepest descendant (a trainer, a datatrove worker)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    if children and rng.random() < 0.5:
        victim = children[-1]
        name = " ".join(victim.cmdline()[1:4])
        victim.kill()
        proc.wait()  # the flow fails the task after retries, or finishes the step: either way it ends
        return f"child ({name})"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return "process group"


def kill_drill(recipe: Path, work: Path, kills: int, rng: random.Random, reference_seconds: float) -> tuple[int, list[str]]:
    run_dir, log = work / "killed", work / "killed.log"
    restarts = 0
    for attempt in range(kills):
        proc = start_pipeline(recipe, run_dir, log)
        delay = rng.uniform(3, reference_seconds * 0.8)
        try:
            proc.wait(timeout=delay)
            print(f"  kill {attempt + 1}: the run finished before its kill at {delay:.0f} s", flush=True)
            break
        except subprocess.TimeoutExpired:
            what = kill_somewhere(proc, rng)
            restarts += 1
            steps = sorted(p.parent.name for p in run_dir.glob("*/manifest.json"))
            print(f"  kill {attempt + 1}: SIGKILL {what} at {delay:.0f} s; finished steps so far: {len(steps)}", flush=True)
    for _ in range(3):  # a kill of a child may fail the run; the rerun resumes
        proc = start_pipeline(recipe, run_dir, log)
        if proc.wait() == 0:
            break
        restarts += 1
        print("  the run after the kill failed; rerunning it", flush=True)
    else:
        return restarts, [f"the pipeline did not complete after the kills (see {log})"]
    return restarts, integrity(run_dir)


class Proxy:
    """A TCP proxy to the S3 server that can be cut and restored: an outage without losing the store."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = threading.Event()
        self.up.set()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            if not self.up.is_set():
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        self.up.clear()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conns.clear()

    def restore(self) -> None:
        self.up.set()


def s3_drill(work: Path, rng: random.Random, outages: int) -> tuple[int, list[str]]:
    port = _free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    os.environ.update(AWS_ACCESS_KEY_ID="drill", AWS_SECRET_ACCESS_KEY="drill-secret", AWS_DEFAULT_REGION="us-east-1")
    try:
        _wait_port(port)
        proxy = Proxy(port)
        endpoint = f"http://127.0.0.1:{proxy.port}"
        import s3fs

        s3fs.S3FileSystem(client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}"}).mkdir("drill")
        run_dir, log = work / "s3run", work / "s3run.log"
        settings = [f"storage.s3.endpoint_url={endpoint}", "storage.mirror=s3://drill/run", "evaluation.follow=false"]
        proc = start_pipeline(MICRO, run_dir, log, settings)
        cut = 0
        while proc.poll() is None and cut < outages:
            uploading = list(run_dir.glob(".partial/pretrain_*/checkpoints/step*/checkpoint.json"))
            if uploading and rng.random() < 0.2:
                seconds = rng.uniform(2, 6)
                proxy.cut()
                time.sleep(seconds)
                proxy.restore()
                cut += 1
                print(f"  outage {cut}: S3 cut for {seconds:.1f} s during pretraining ({len(uploading)} checkpoints so far)", flush=True)
            time.sleep(1)
        if proc.wait() != 0:
            return cut, [f"the mirrored run failed (see {log})"]
        from infra.recipe import load_recipe
        from infra.steps import MANIFEST
        from infra.storage import Mirror
        from model.checkpoint import MARKER

        r = load_recipe(MICRO, settings)
        mirror = Mirror(r.storage.mirror, r.storage.s3)
        problems = []
        for manifest in run_dir.glob("*/manifest.json"):
            name = manifest.parent.name
            if mirror.read_marker(name, MANIFEST) is None:
                problems.append(f"step {name} is not on S3")
            summary = json.loads(manifest.read_text())["summary"]
            if summary.get("failed_uploads"):
                problems.append(f"{name}: uploads given up: {summary['failed_uploads']}")
        for root in run_dir.glob("pretrain_*/checkpoints"):
            sid = json.loads((root.parent / MANIFEST).read_text())["step_id"]
            for folder in root.glob("step*"):
                if mirror.read_marker(f"checkpoints/{root.parent.name}-{sid}/{folder.name}", MARKER) is None:
                    problems.append(f"checkpoint {folder} is not on S3")
        return cut, problems + integrity(run_dir)
    finally:
        moto.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int) -> None:
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs in the kill drill")
    parser.add_argument("--outages", type=int, default=2, help="S3 outages in the S3 drill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep run dirs here [default: a temp dir, removed]")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="smolflow-drills-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe = MICRO

    print("reference: uninterrupted run", flush=True)
    started = time.time()
    if start_pipeline(recipe, work / "reference", work / "reference.log").wait() != 0:
        print(f"the reference run failed: {work / 'reference.log'}")
        return 1
    reference_seconds = time.time() - started
    print(f"  {reference_seconds:.0f} s", flush=True)

    print(f"kill drill: {args.kills} SIGKILLs at random moments", flush=True)
    restarts, problems = kill_drill(recipe, work, args.kills, rng, reference_seconds)
    diffs = compare(final_metrics(work / "reference"), final_metrics(work / "killed")) if not problems else []
    print(f"  {restarts} restarts; {len(problems)} integrity problems; {len(diffs)} metric differences", flush=True)
    print(f"s3 drill: {args.outages} outages during checkpoint uploads", flush=True)
    cuts, s3_problems = s3_drill(work, rng, args.outages)

    print("\n| drill | interruptions | result |\n|---|---|---|")
    print(f"| kill | {restarts} restarts | {'OK: same final metrics, nothing lost' if not problems and not diffs else 'FAILED'} |")
    print(f"| s3 outage | {cuts} outages | {'OK: every step and checkpoint on S3' if not s3_problems else 'FAILED'} |")
    for line in problems + diffs + s3_problems:
        print(f"  - {line}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if problems or diffs or s3_problems else 0


if __name__ == "__main__":
    sys.exit(main())
