"""Failure drills on a micro recipe: kill every training stage and the evaluator, cut S3, fill a disk.

    python bench/drills.py --kills 20 --outage-seconds 60 --seed 0

1. Reference: the pipeline (curate -> pretrain -> SFT -> pairs -> APO -> GRPO -> evaluate) runs once.
2. Kill drill: the same pipeline in a fresh run dir is SIGKILLed N times, each time while a chosen
   target runs (N/6 each, in pipeline order: curation with its pool workers, a pretraining trainer and an
   evaluation child alternately, then SFT, APO, GRPO), either that process, the flow process's whole
   group, or the flow process alone (as the OOM killer would), and restarted. A watcher counts trainers
   alive at once. After each kill of the flow process, a census of the processes carrying its tree mark
   (infra/procs.py) and of its forks (its command line): what is left 20 s later is an orphan.
   Afterwards: it completed, every kept checkpoint is complete, no lock is left, no two trainers ever
   ran at once, no orphan, and final metrics (losses per stage, post-training curves, every evaluation)
   equal the reference's.
3. Slurm drill: the same pipeline up to pretraining with every phase a Slurm job on a local cluster, SIGKILLed
   --slurm-kills times while a job trains (a rank of the job, or the flow process alone, at random).
   Afterwards: it completed with the reference's pretraining losses and weights, no job is left in the
   queue, no two trainers ever ran at once, no orphan.
4. S3 drill: pretraining mirrors to a moto S3 server reached through a TCP proxy, cut for
   --outage-seconds (longer than the upload retry budget) while a checkpoint uploads. Afterwards every
   step and checkpoint is on S3 with its marker, and no upload was given up.
5. Full-disk drill (root: a tmpfs): a pretraining phase whose checkpoints go to a disk that holds two
   of them and no more finishes with the losses of the reference phase (it prunes before saving), and
   one on a disk too small for any fails naming the folder and the space needed.
6. Full disk per stage (root): the whole pipeline on a tmpfs that fills as each of --full-stages begins (a
   ballast file leaves half of the most that stage's steps held while they built, sampled during the
   reference). It must fail naming the disk and its free space, leave every committed step as its
   manifest records it, and, once the ballast is gone, complete with the reference's final metrics.

Prints one line per event and a summary table; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


SMOLFLOW = str(Path(sys.executable).with_name("smolflow"))
MICRO = REPO / "configs" / "micro.yaml"
DISK_TRACE = "reference.disk.json"  # the reference's DiskTrace, beside it in the workdir
QUICK = [  # a short ladder that still yields preference pairs (a weak and a stronger SFT model on small sums)
    "postrain.data.families={arithmetic: 1.0}",
    "postrain.data.max_value=5",
    "postrain.data.generated=1500",
    "postrain.data.heldout=40",
    "postrain.sft.max_steps=400",
    "postrain.sft.weak_checkpoint_step=20",
    "postrain.sft.save_steps=50",
    "postrain.preference.prompts=120",
    "postrain.apo.max_steps=12",
    "postrain.apo.save_steps=4",
    "postrain.apo.logging_steps=4",  # a logged loss averages the steps since the last log: align logs with resumable saves
    "postrain.grpo.max_steps=6",
    "postrain.grpo.save_steps=2",
    "postrain.grpo.logging_steps=2",
    "postrain.grpo.prompts=64",
]
# what each kill waits for: a process whose command line holds the marker, or a stage's partial folder
TARGETS = {
    "curation": (None, "filter"),  # datatrove's pool workers run its shards
    "trainer": ("model.train", None),
    "evaluator": ("tasks.evaluation.harness", None),
    "sft": (None, "sft"),
    "apo": (None, "apo"),
    "grpo": (None, "grpo"),
}


def start_pipeline(recipe: Path, run_dir: Path, log_path: Path, extra: list[str] = (), until: str | None = None) -> subprocess.Popen:
    command = [SMOLFLOW, "run", str(recipe), "--run-dir", str(run_dir)] + (["--until", until] if until else [])
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
    for stage in [s for s in ("sft", "apo", "grpo") if (run_dir / s / "manifest.json").exists()]:
        summary = json.loads((run_dir / stage / "manifest.json").read_text())["summary"]
        for curve in ("loss", "reward"):
            if curve in summary:
                out[f"{stage}_{curve}"] = [[step, round(value, 4)] for step, value in summary[curve]]
        out[f"{stage}_accuracy"] = summary["eval"]["accuracy"]
    for manifest in sorted(run_dir.glob("*/manifest.json")):  # the exported weights, bit for bit (their recorded MD5)
        if weights := json.loads(manifest.read_text()).get("files", {}).get("final/model.safetensors"):
            out[f"{manifest.parent.name} weights MD5"] = weights["md5"]
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
    problems += [f"lock left behind: {p}" for p in (run_dir / "steps" / ".partial").glob("*.lock")]
    return problems


def pruned_unscored(run_dir: Path) -> set[str]:
    """The checkpoints (as the evaluator labels them: `phase1/step00000005`) a trainer of RUN_DIR deleted before the
    evaluator scored them, as its launch log says. The store holds only so many for an evaluator that falls behind
    (`tasks/pretrain.py: HOLD_FOR_EVAL`), so which go unscored depends on the evaluator's timing, not on a kill or a
    full disk: the micro recipe's phase 1 writes 7 checkpoints in about a second."""
    said = "deleted before the evaluator scored it"
    return {
        f"{log.parent.name.removeprefix('pretrain_')}/{tag}"
        for log in run_dir.glob("pretrain_*/launch.log")
        for tag in re.findall(rf"checkpoint (step\d+) {said}", log.read_text(errors="replace"))
    }


def compare_runs(reference: Path, drilled: Path) -> list[str]:
    """`compare` of the two runs' final metrics, where a checkpoint's scores missing from a run whose trainer said it
    deleted that checkpoint unscored (`pruned_unscored`) are not a difference; the difference is named if it is."""
    unscored = (pruned_unscored(reference), pruned_unscored(drilled))
    return compare(final_metrics(reference), final_metrics(drilled), unscored=unscored)


def compare(reference: dict, drilled: dict, rel: float = 1e-4, unscored: tuple[set[str], set[str]] = (set(), set())) -> list[str]:
    diffs = []
    for key in sorted(set(reference) | set(drilled)):
        a, b = reference.get(key), drilled.get(key)
        label = key.split()[1] if key.startswith("eval ") else None
        if (a is None and label in unscored[0]) or (b is None and label in unscored[1]):
            continue
        if isinstance(a, float) and isinstance(b, float):
            if abs(a - b) > rel * max(1.0, abs(a)):
                diffs.append(f"{key}: {a} vs {b}")
        elif a != b:
            diffs.append(f"{key}: {a} vs {b}")
    return diffs


def trainers(run_dir: Path) -> list[psutil.Process]:
    """Pretraining trainers of RUN_DIR alive now (wherever they run: under the flow, srun or a Ray worker), zombies
    (killed, not yet reaped) and the tethering wrappers left out."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status", "ppid", "create_time"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and "model.train" in cmd and "infra.procs" not in cmd:
            found += [proc] if any(str(run_dir) in part for part in cmd) else []
    return found


class TrainerWatch:
    """Counts pretraining trainers alive at once under one run dir, polling every 0.2 s; zombies (killed, not yet
    reaped) do not count. When more than one is alive it keeps what they were, to say which."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.most, self.seen, self._stop = run_dir, 0, [], threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            alive = [
                f"pid {p.pid} (parent {p.info['ppid']}, started {p.info['create_time']:.1f}): {p.info['cmdline'][-1]}"
                for p in trainers(self.run_dir)
            ]
            if len(alive) > 1:
                self.seen.append(f"{time.strftime('%H:%M:%S')}: {'; '.join(alive)}")
            self.most = max(self.most, len(alive))

    def stop(self) -> int:
        self._stop.set()
        return self.most


def pending(run_dir: Path) -> list[str]:
    """The targets whose stage has not finished yet (the evaluator scores until the report card is written)."""
    done = lambda step: (run_dir / step / "manifest.json").exists()  # noqa: E731
    left = [] if done("mixtures") else ["curation"]
    left += [] if done("pretrain_long_context") else ["trainer"]
    left += [stage for stage in ("sft", "apo", "grpo") if not done(stage)]
    return left + ([] if (run_dir / "reports" / "card.md").exists() else ["evaluator"])


def wait_for(target: str, proc: subprocess.Popen, run_dir: Path, timeout_s: float) -> psutil.Process | None:
    """The process to kill once TARGET runs (None: its stage runs inside the flow process); TimeoutError when the
    run ends or the target's stage finishes first."""
    marker, stage = TARGETS[target]
    deadline = time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline and target in pending(run_dir):
        if marker:
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    # a descendant of the run's flow process is the run's: a shared eval child names no run dir
                    if marker in child.cmdline():
                        return child
                except psutil.NoSuchProcess:
                    pass
        elif (run_dir / ".partial" / stage).is_dir():  # the link to its build in the store: the step started
            return None
        time.sleep(0.05)
    raise TimeoutError(target)


@dataclass(frozen=True)
class Tree:
    """What a flow process starts: MARK is the mark the CLI gives it (infra/procs.py `reap_when_gone`); a fork that
    does not exec shows COMMAND, the flow process's command line, instead (its /proc environ is its parent's at exec)."""

    mark: str
    command: tuple[str, ...]


def tree_of(proc: subprocess.Popen) -> Tree:
    from infra.procs import Proc

    # Popen returns once exec closed its pipe, before the kernel sets the new command line: it reads empty a moment
    # (as a zombie's does), and an empty one would match every kernel thread
    deadline = time.time() + 10
    while not (command := tuple(psutil.Process(proc.pid).cmdline())):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the flow process {proc.pid} shows no command line (exit {proc.poll()})")
        time.sleep(0.01)
    return Tree(Proc.of(proc.pid).token, command)


def left_of(tree: Tree) -> list[psutil.Process]:
    """The processes of a gone flow process's TREE that still run, before anything relaunches it: those that carry its
    mark, and its forks (its command line, started after it)."""
    from infra.procs import Proc, census, start_ticks

    started, forks = Proc.parse(tree.mark).started, []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if tuple(proc.info["cmdline"] or ()) == tree.command and proc.info["status"] != psutil.STATUS_ZOMBIE:
            with contextlib.suppress(OSError):  # gone since
                if start_ticks(proc.pid) >= started:
                    forks.append(proc)
    return list({p.pid: p for p in census(tree.mark) + forks}.values())


def orphans(tree: Tree, wait_s: float = 20) -> list[str]:
    """What of a gone flow process's TREE still runs WAIT_S after it ended; killed, then named."""
    from infra.procs import kill_tree

    deadline = time.time() + wait_s
    while (left := left_of(tree)) and time.time() < deadline:
        time.sleep(0.5)
    named = []
    for proc in left:
        try:
            named.append(f"pid {proc.pid}: {' '.join(proc.cmdline()[:4])}")
        except psutil.Error:
            continue  # it ended between the census and now: no orphan
        kill_tree(proc)
    return named


def kill_drill(recipe: Path, work: Path, kills: int, rng: random.Random) -> tuple[int, int, list[str]]:
    """Returns (kills made, most trainers alive at once, problems)."""
    run_dir, log = work / "killed", work / "killed.log"
    each = max(1, kills // len(TARGETS))  # spread over the stages in pipeline order; the evaluator alongside pretraining
    plan = ["curation"] * each + ["trainer", "evaluator"] * each
    plan += [t for t in TARGETS if t not in ("curation", "trainer", "evaluator") for _ in range(each)]
    plan += ["evaluator"] * (kills - len(plan))
    watch, made, left = TrainerWatch(run_dir), 0, []
    proc = start_pipeline(recipe, run_dir, log)
    tree = tree_of(proc)
    while made < kills and plan and pending(run_dir):
        target = plan[0]
        try:
            victim = wait_for(target, proc, run_dir, timeout_s=1800)
        except TimeoutError:
            if proc.poll() is not None and proc.returncode != 0:
                print("  the run failed after a kill; restarting it", flush=True)
                left += orphans(tree)
                proc = start_pipeline(recipe, run_dir, log)
                tree = tree_of(proc)
            elif proc.poll() is not None:
                break  # finished
            else:
                plan.pop(0)  # its stage is over: the evaluator takes this kill
                plan.append("evaluator")
            continue
        plan.pop(0)
        time.sleep(rng.uniform(0.2, 1) if target == "curation" else rng.uniform(0.5, 6))  # inside the stage, not at its first instant
        if victim is not None and rng.random() < 0.5:
            try:
                victim.kill()  # the task fails and retries, resuming: the run goes on
            except psutil.NoSuchProcess:
                continue
            what = f"only the {target} (pid {victim.pid})"
        else:
            marked = len([p for p in left_of(tree) if p.pid != proc.pid])
            if rng.random() < 0.5:
                os.killpg(proc.pid, signal.SIGKILL)
                what = f"the whole run's process group while the {target} ran"
            else:  # as the OOM killer would: what it started lives on unless reaped
                proc.kill()
                what = f"the flow process alone while the {target} ran"
            proc.wait()
        made += 1
        found = orphans(tree) if proc.poll() is not None else []
        left += found
        print(
            f"  kill {made}: SIGKILL {what}; finished steps so far: {len(list(run_dir.glob('*/manifest.json')))}"
            + (f"; processes it started: {marked} at the kill, {len(found)} 20 s later" if proc.poll() is not None else ""),
            flush=True,
        )
        if proc.poll() is not None:
            proc = start_pipeline(recipe, run_dir, log)
            tree = tree_of(proc)
    for _ in range(4):  # finish: a kill of a child may have failed the run; the rerun resumes
        if proc.wait() == 0:
            break
        print("  the run after the kills failed; rerunning it", flush=True)
        left += orphans(tree)
        proc = start_pipeline(recipe, run_dir, log)
        tree = tree_of(proc)
    else:
        return made, watch.stop(), [f"the pipeline did not complete after the kills (see {log})"]
    left += orphans(tree)  # a run that ended well leaves nothing either
    most = watch.stop()
    problems = integrity(run_dir) + ([f"{most} trainers were alive at once: {watch.seen[:3]}"] if most > 1 else [])
    problems += [f"outlived its run: {name}" for name in left]
    if made < kills:  # a drill that could not make its kills checked less than it was asked to
        problems.append(f"{made} of {kills} kills made: the run ended before these targets ran: {', '.join(plan)}")
    return made, most, problems


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


def slurm_drill(work: Path, rng: random.Random, kills: int) -> tuple[int, int, list[str]]:
    """The reference's pipeline up to pretraining with every phase a Slurm job on a local cluster (flows/cluster.py),
    SIGKILLed KILLS times while a job trains: half the time a rank of the job (srun reports it and the job fails
    or requeues; the task resumes), else the flow process alone (the job lives on; the relaunch must not run a
    second trainer beside it). Returns (kills made, most trainers alive at once, problems): afterwards the run
    completed with the reference's pretraining losses and weights, no job is left in the queue, and no process
    of a killed flow outlived it."""
    from flows.cluster import Slurm, free_port_pair

    cluster = Slurm(state=work / "slurm", port=free_port_pair())
    cluster.start(timeout_s=180, say=lambda line: None)
    os.environ["SLURM_CONF"] = str(cluster.conf)
    run_dir, log = work / "slurm-run", work / "slurm-run.log"
    extra = ["pretrain.launcher.kind=slurm", "pretrain.launcher.slurm.time='60'"]
    watch, made, left, problems = TrainerWatch(run_dir), 0, [], []
    try:
        proc = start_pipeline(MICRO, run_dir, log, extra, until="pretrain")
        tree = tree_of(proc)
        while made < kills and proc.poll() is None and "trainer" in pending(run_dir):
            if not (ranks := trainers(run_dir)):
                time.sleep(0.2)
                continue
            time.sleep(rng.uniform(0.5, 4))  # inside the phase, not at its first instant
            if rng.random() < 0.5:
                try:
                    ranks[0].kill()
                except psutil.NoSuchProcess:
                    continue
                what = f"a rank of the Slurm job (pid {ranks[0].pid})"
            else:
                proc.kill()
                proc.wait()
                what = "the flow process alone while its Slurm job trained"
            made += 1
            found = orphans(tree) if proc.poll() is not None else []
            left += found
            print(f"  slurm kill {made}: SIGKILL {what}; queue: {[j['name'] for j in cluster.jobs()]}", flush=True)
            if proc.poll() is not None:
                proc = start_pipeline(MICRO, run_dir, log, extra, until="pretrain")
                tree = tree_of(proc)
        for _ in range(4):  # a killed rank may have failed the run: the rerun resumes
            if proc.wait() == 0:
                break
            print("  the run after the kills failed; rerunning it", flush=True)
            left += orphans(tree)
            proc = start_pipeline(MICRO, run_dir, log, extra, until="pretrain")
            tree = tree_of(proc)
        else:
            problems.append(f"the pipeline did not complete after the kills (see {log})")
        left += orphans(tree)
        if jobs := cluster.jobs():
            problems.append(f"jobs left in the queue: {jobs}")
    finally:
        most = watch.stop()
        cluster.stop()
    if not problems:
        pretrained = lambda metrics: {k: v for k, v in metrics.items() if k.startswith("pretrain_")}  # noqa: E731
        problems += compare(pretrained(final_metrics(work / "reference")), pretrained(final_metrics(run_dir)))
    problems += integrity(run_dir) + ([f"{most} trainers were alive at once: {watch.seen[:3]}"] if most > 1 else [])
    return made, most, problems + [f"outlived its run: {name}" for name in left]


def checkpoints(run_dir: Path) -> set[str]:
    """PHASE/TAG of every committed checkpoint of the phase being trained."""
    return {f"{p.parent.parent.parent.name}/{p.parent.name}" for p in run_dir.glob(".partial/pretrain_*/checkpoints/step*/checkpoint.json")}


def s3_drill(work: Path, rng: random.Random, outages: int, seconds: float) -> tuple[int, list[str]]:
    from infra.launch import free_port

    port = free_port()
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
        proc = start_pipeline(MICRO, run_dir, log, settings, until="pretrain")
        cut, seen = 0, set()
        while proc.poll() is None and cut < outages:
            committed = checkpoints(run_dir)
            if seen and committed - seen:  # a checkpoint was just committed (not the first): its upload is starting
                proxy.cut()
                time.sleep(seconds)
                proxy.restore()
                cut += 1
                print(f"  outage {cut}: S3 cut for {seconds:.0f} s as {sorted(committed - seen)[0]} uploaded", flush=True)
                committed = checkpoints(run_dir)
            seen |= committed
            time.sleep(0.1)
        for _ in range(3):  # the cap on checkpoints waiting for S3 may have failed the trainer: a rerun resumes
            if proc.wait() == 0:
                break
            print("  the mirrored run failed (the outage outlasted its retries); rerunning it", flush=True)
            proc = start_pipeline(MICRO, run_dir, log, settings, until="pretrain")
        else:
            return cut, [f"the mirrored run failed (see {log})"]
        from infra.recipe import load_recipe
        from infra.steps import MANIFEST
        from infra.storage import Mirror
        from model.checkpoint import MARKER

        r = load_recipe(MICRO, settings)
        mirror = Mirror(r.storage.mirror, r.storage.s3)
        problems = []
        for manifest in run_dir.glob("*/manifest.json"):
            name = manifest.parent.resolve().name  # NAME-ID, as the mirror holds it
            if mirror.read_marker(name, MANIFEST) is None:
                problems.append(f"step {name} is not on S3")
            summary = json.loads(manifest.read_text())["summary"]
            if summary.get("failed_uploads"):
                problems.append(f"{name}: uploads given up: {summary['failed_uploads']}")
        for root in run_dir.glob("pretrain_*/checkpoints"):
            for folder in root.glob("step*"):
                if mirror.read_marker(f"{root.parent.resolve().name}/checkpoints/{folder.name}", MARKER) is None:
                    problems.append(f"checkpoint {folder} is not on S3")
        return cut, problems + integrity(run_dir)
    finally:
        moto.kill()


def _wait_port(port: int) -> None:
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port}")


def disk_drill(work: Path) -> tuple[str, list[str]]:
    """The reference's first pretraining phase again, its checkpoints (5 of them, 2 kept) on a tmpfs that holds
    two and a half, then on one that holds half of one."""
    if os.geteuid() != 0:
        return "skipped (mounting a tmpfs needs root)", []
    from infra.launch import launch_command, launch_env, run_streaming
    from infra.recipe import LauncherCfg
    from model.checkpoint import checkpoint_bytes
    from model.config import TrainJob

    phase = work / "reference" / "pretrain_phase1"
    reference = TrainJob.model_validate_json((phase / "job.json").read_text())
    every = max(1, reference.config.schedule.steps // 5)
    checkpoint = reference.config.checkpoint.model_copy(update={"every_steps": every})
    # no evaluator follows this trainer: with the reference's hold, the save that must prune waits EVAL_WAIT_S for
    # scores that never come, then fails
    config = reference.config.model_copy(update={"checkpoint": checkpoint, "hold_unevaluated": 0})
    launcher = LauncherCfg(kind="python", nproc=1, threads_per_rank=2)
    size = checkpoint_bytes(max((phase / "checkpoints").glob("step*")))
    problems, mounts, codes = [], [], {}
    try:
        for name, factor in (("small", 2.6), ("full", 0.5)):
            disk, out = work / f"disk-{name}", work / f"disk-{name}-out"
            disk.mkdir()
            out.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(factor * size)}", "tmpfs", str(disk)], check=True)
            mounts.append(disk)
            job = reference.model_copy(update={"config": config, "out_dir": str(out), "checkpoint_dir": str(disk / "ckpt"), "mirror": None})
            (out / "job.json").write_text(job.model_dump_json())
            lines: list[str] = []
            command = launch_command(launcher, "model.train", [str(out / "job.json")], 0)
            codes[name] = run_streaming(command, launch_env(launcher), lines.append)
            if name == "small":
                losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()] if codes[name] == 0 else []
                expected = [json.loads(line)["loss"] for line in (phase / "metrics.jsonl").read_text().splitlines()]
                if losses != expected:
                    problems.append(f"a phase on a disk for two checkpoints ended (exit {codes[name]}) without the reference losses")
            elif codes[name] == 0 or not any("DiskFull" in line and str(disk) in line for line in lines):
                problems.append("a disk too small for a checkpoint did not fail with a message naming it")
    finally:
        for disk in mounts:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    sizes = f"tmpfs of 2.6x (exit {codes.get('small')}) and 0.5x (exit {codes.get('full')})"
    return f"checkpoints of {size / 2**20:.1f} MiB every {every} steps on {sizes}", problems


class DiskTrace:
    """The most each stage's steps hold while they build (their folders in the store's `.partial/`, checkpoints written
    and pruned on the way included, which their committed folders do not show), sampled every INTERVAL_S from a thread
    while the run goes: what the stage drill leaves free as a stage begins."""

    INTERVAL_S = 0.5

    def __init__(self, run_dir: Path):
        self.run_dir, self.stage_of = run_dir, stage_of_steps(micro_graph())
        self.peaks: dict[str, int] = {}  # stage -> bytes
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while not self.done.wait(self.INTERVAL_S):
            for stage, folders in building(self.run_dir, self.stage_of).items():
                self.peaks[stage] = max(self.peaks.get(stage, 0), sum(map(tree_bytes, folders)))

    def __enter__(self) -> DiskTrace:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def micro_graph():
    """The step graph of the drills' pipeline."""
    from flows.graph import build_graph
    from infra.recipe import load_recipe

    return build_graph(load_recipe(MICRO, QUICK))


def stage_of_steps(graph) -> dict[str, str]:
    """Step name -> its stage."""
    return {step.name: step.stage for step in graph.steps}


def building(run_dir: Path, stage_of: dict[str, str]) -> dict[str, list[Path]]:
    """The stages with steps being built in RUN_DIR's store (folders in `.partial/`), and those folders; none before
    the store is made."""
    from infra.steps import PARTIAL

    out: dict[str, list[Path]] = {}
    with contextlib.suppress(FileNotFoundError):
        for folder in (run_dir / "steps" / PARTIAL).iterdir():
            if folder.is_dir() and (stage := stage_of.get(folder.name.rsplit("-", 1)[0])):
                out.setdefault(stage, []).append(folder)
    return out


def stage_disk_drill(work: Path, stages: list[str]) -> tuple[list[str], list[str]]:
    """The pipeline again on a tmpfs that fills as each of STAGES begins: once one of its steps has a folder in the
    store's `.partial/`, a ballast file takes all the free space but half of the most that stage's steps held while
    they built in the reference (`DiskTrace`). The run must fail with a message
    naming the disk and its free space, every committed step must still match its manifest, and once the ballast is
    gone the relaunch must complete with the reference's final metrics. Returns a row per stage and the problems."""
    if os.geteuid() != 0:
        return ["| full disk, per stage | none | skipped: mounting a tmpfs needs root | 0 |"], []
    from flows.graph import STAGES
    from infra.steps import MANIFEST

    graph = micro_graph()
    stage_of = stage_of_steps(graph)
    reference, traced = work / "reference", work / DISK_TRACE
    if not traced.is_file():
        return [f"| full disk, per stage | none | skipped: no {DISK_TRACE} beside a kept reference: rerun it | 0 |"], []
    peaks = json.loads(traced.read_text())
    order, size = [s for s in STAGES if graph.stage(s)], 4 * tree_bytes(reference)  # room for any stage but the ballast
    rows, problems = [], []
    for stage in stages:
        started, found = time.time(), []
        left = peaks.get(stage, 0) // 2 // 4096 * 4096  # what the stage finds free: half its peak, in whole pages
        disk, log = work / f"full-{stage}", work / f"full-{stage}.log"
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
        try:
            run_dir, ballast = disk / "run", disk / "ballast"
            pipeline = start_pipeline(MICRO, run_dir, log)
            while pipeline.poll() is None and stage not in building(run_dir, stage_of):
                time.sleep(0.1)
            if pipeline.poll() is None:
                with open(ballast, "wb") as f:
                    free = os.statvfs(disk)
                    os.posix_fallocate(f.fileno(), 0, max(4096, free.f_bavail * free.f_frsize - left))
            code = pipeline.wait()
            lines = log.read_text(errors="replace").splitlines()
            failed_in = next((s for s in order if any(not (run_dir / st.name / MANIFEST).exists() for st in graph.stage(s))), None)
            named = [line for line in lines if "DiskFull" in line and str(disk) in line and "MiB free" in line]  # a step's, a checkpoint's
            if not ballast.exists():
                found.append(f"{stage}: the run ended (exit {code}) before {stage} began (see {log})")
            elif code == 0:
                found.append(f"{stage}: the run completed on a disk with {left / 2**20:.1f} MiB free as {stage} began")
            elif not named:
                said = next((line for line in lines if "no space left" in line.lower()), "(no line says so)")
                found.append(f"{stage}: the failure does not name the disk and its free space: {said.strip()[:300]}")
            elif failed_in != stage:
                found.append(f"{stage}: the disk filled as {stage} began, but the run stopped in {failed_in}")
            if retried := [line for line in lines if "will start" in line and "Retry" in line]:  # Prefect's retry line
                found.append(f"{stage}: a full disk was retried {len(retried)}x, as if a retry could fix it: {retried[0].strip()[:200]}")
            found += [f"{stage}: committed file damaged: {rel}" for rel in damaged(run_dir / "steps")]
            ballast.unlink(missing_ok=True)
            if start_pipeline(MICRO, run_dir, log).wait() != 0:
                found.append(f"{stage}: the relaunch with the space back failed (see {log})")
            else:
                found += [f"{stage}: {d}" for d in compare_runs(reference, run_dir)]
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)
        message = named[0].split("DiskFull", 1)[1].strip(" :'(").replace(str(disk), "<disk>")[:160] if code and named else "-"
        verdict = "OK: named, nothing committed damaged, the relaunch ends as the reference" if not found else "FAILED"
        rows.append(
            f"| full disk in {stage} | {left / 2**20:.1f} MiB free as it began, failed in {failed_in} (exit {code}): {message} "
            f"| {verdict} | {time.time() - started:.0f} |"
        )
        problems += found
    return rows, problems


def tree_bytes(root: Path) -> int:
    """What ROOT's files take on a tmpfs, each rounded up to whole 4 KiB pages; links are not followed, and a file that
    goes while it is counted (a running build's) counts nothing."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISLNK((st := os.lstat(os.path.join(folder, name))).st_mode):
                    total += -(-st.st_size // 4096) * 4096
    return total


def damaged(store: Path) -> list[str]:
    """Files of STORE's committed steps that differ from their manifest's record (size, MD5) or are gone."""
    from infra.steps import MANIFEST
    from infra.storage import file_digest

    out = []
    for manifest in store.glob(f"*/{MANIFEST}"):
        for rel, want in json.loads(manifest.read_text()).get("files", {}).items():
            path = manifest.parent / rel
            if not path.is_file() or path.stat().st_size != want["size"] or file_digest(path, "md5") != want["md5"]:
                out.append(f"{manifest.parent.name}/{rel}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs in the kill drill (each target once, then at random)")
    parser.add_argument("--outages", type=int, default=1, help="S3 outages in the S3 drill")
    parser.add_argument("--outage-seconds", type=float, default=60, help="how long each S3 outage lasts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep run dirs here (default: a temp dir, removed)")
    parser.add_argument("--slurm-kills", type=int, default=4, help="SIGKILLs in the Slurm drill (a job's rank or the flow process)")
    parser.add_argument("--drills", default="kill,slurm,s3,disk,stages", help="which drills to run after the reference (comma-separated)")
    parser.add_argument(
        "--full-stages", default="curate,pretrain,sft,preference,apo,grpo", help="the stages the `stages` drill fills the disk in"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="smolflow-drills-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe, times = MICRO, {}

    print("reference: uninterrupted run", flush=True)
    started, kept = time.time(), work / "reference.seconds"
    if kept.exists():  # a workdir kept from an earlier drill: its reference is reused
        times["reference"] = float(kept.read_text())
    else:
        with DiskTrace(work / "reference") as trace:
            code = start_pipeline(recipe, work / "reference", work / "reference.log").wait()
        if code != 0:
            print(f"the reference run failed: {work / 'reference.log'}")
            return 1
        times["reference"] = time.time() - started
        kept.write_text(str(times["reference"]))
        (work / DISK_TRACE).write_text(json.dumps(trace.peaks))
    print(f"  {times['reference']:.0f} s", flush=True)

    chosen, rows, failures = set(args.drills.split(",")), [f"| reference | none | completed | {times['reference']:.0f} |"], []
    if "kill" in chosen:
        print(f"kill drill: {args.kills} SIGKILLs across {', '.join(TARGETS)}", flush=True)
        started = time.time()
        made, most, problems = kill_drill(recipe, work, args.kills, rng)
        completed = (work / "killed" / "reports" / "card.md").exists()
        diffs = compare_runs(work / "reference", work / "killed") if completed else []
        print(f"  {made} kills; {len(problems)} problems; {len(diffs)} metric differences; most trainers at once: {most}", flush=True)
        verdict = "OK: same final metrics and weights, nothing lost" if not problems and not diffs else "FAILED"
        rows.append(f"| kill | {made} SIGKILLs, most trainers at once {most} | {verdict} | {time.time() - started:.0f} |")
        failures += problems + diffs
    if "slurm" in chosen and os.geteuid() != 0:
        rows.append("| slurm | none | skipped: the local Slurm cluster runs its daemons as root | 0 |")
    elif "slurm" in chosen:
        print(f"slurm drill: {args.slurm_kills} SIGKILLs of pretraining jobs' ranks or of the flow process", flush=True)
        started = time.time()
        made, most, problems = slurm_drill(work, rng, args.slurm_kills)
        verdict = "OK: the reference's pretraining, no job left" if not problems else "FAILED"
        rows.append(f"| slurm | {made} SIGKILLs, most trainers at once {most} | {verdict} | {time.time() - started:.0f} |")
        failures += problems
    if "s3" in chosen:
        print(f"s3 drill: {args.outages} outage(s) of {args.outage_seconds:.0f} s during checkpoint uploads", flush=True)
        started = time.time()
        cuts, problems = s3_drill(work, rng, args.outages, args.outage_seconds)
        verdict = "OK: every step and checkpoint on S3" if not problems else "FAILED"
        rows.append(f"| s3 outage | {cuts} x {args.outage_seconds:.0f} s | {verdict} | {time.time() - started:.0f} |")
        failures += problems
    if "disk" in chosen:
        print("full-disk drill", flush=True)
        started = time.time()
        disk, problems = disk_drill(work)
        rows.append(f"| full disk | {disk} | {'OK' if not problems else 'FAILED'} | {time.time() - started:.0f} |")
        failures += problems
    if "stages" in chosen:
        print(f"full-disk drill per stage: {args.full_stages}", flush=True)
        stage_rows, problems = stage_disk_drill(work, args.full_stages.split(","))
        rows += stage_rows
        failures += problems

    print("\n| drill | interruptions | result | seconds |\n|---|---|---|---|")
    print("\n".join(rows))
    for line in failures:
        print(f"  - {line}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
