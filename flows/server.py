"""A local Prefect server, work pool, worker and crash relaunch: `smolflow server start|stop|status`.

Everything lives under the project's state dir (`.smolflow/`, or $SMOLFLOW_STATE), private to its
user (0700, files 0600; the server and worker write with umask 077): the SQLite database with every
flow run's parameters, logs and artifacts, PREFECT_HOME, logs and PID files. The server listens on 127.0.0.1 only and asks for an
auth string (generated once into `.smolflow/auth`, mode 0600; `source .smolflow/env`, also 0600, gives
it to the prefect CLI), so another local user cannot run a deployment with recipe values of theirs. `start` is
idempotent (a running server or worker is left alone); `stop` stops workers before the server,
since a worker whose server vanished first retries its connection instead of exiting. A worker whose
server dies is stopped within a second (infra/procs.py `guarded`): it would otherwise go on sending the
auth string to whatever process binds the port next. Within that second its first reconnect can still
reach a process that bound the port at once (seen once on a loaded machine): the client itself does not
check who listens. `.smolflow/env` does, when a shell sources it (`owns_port`), and leaves the auth string
unset if the port is not our server's.

Work pool `smolflow` (type process) has three queues: `default` for the pipeline and stage flows and
`eval` for scheduled evaluation, one flow run at a time each, so evaluation never takes the training
slot (and its processes run at a lower CPU priority, tasks/evaluation/); `control` runs the crash
checks of flows/relaunch.py, which the automation starts for every crash Prefect reports of a run
tagged `smolflow`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psutil

from infra.env import OFFLINE_DEFAULTS, PRIVATE_UMASK, private_dir, write_private
from infra.errors import SmolflowError
from infra.procs import Proc, detached, guarded

POOL = "smolflow"
QUEUES = {"default": 1, "eval": 1, "control": 2}  # queue -> concurrency limit
AUTOMATION = "smolflow: check crashed flow runs"
OLD_AUTOMATIONS = ("smolflow: reschedule crashed flow runs",)  # blind rescheduling, replaced by the check
RELAUNCH = "relaunch-crashed/check"  # flow/deployment of flows/relaunch.py
TAG = "smolflow"  # deployments carrying this tag are relaunched after a real crash
MAX_ATTEMPTS = 3  # a run that crashed on its 3rd attempt stays Crashed
HEARTBEAT_S = 30  # flow processes beat this often (PREFECT_FLOWS_HEARTBEAT_FREQUENCY; Prefect's minimum)
GRACE_S = 2 * HEARTBEAT_S + 15  # a live process that was reported crashed beats, or moves on, within this


@dataclass(frozen=True)
class Server:
    root: Path  # the repository: deployments run their flows from here
    state: Path
    port: int = 4200

    @classmethod
    def here(cls, port: int | None = None) -> Server:
        root = Path.cwd().resolve()
        state = Path(os.environ.get("SMOLFLOW_STATE", root / ".smolflow")).resolve()
        return cls(root=root, state=state, port=port or int(os.environ.get("SMOLFLOW_PORT", "4200")))

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def auth(self) -> str:
        """The server's basic-auth string, made on first use and readable by this user only."""
        path = self.state / "auth"
        if not path.exists():
            private_dir(self.state)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"smolflow:{secrets.token_urlsafe(24)}")
        return path.read_text().strip()

    def env(self) -> dict[str, str]:
        """The environment of the server, the worker and the user's Prefect commands (with the local Slurm's, if any)."""
        slurm_conf = self.state / "slurm" / "slurm.conf"  # flows/cluster.py
        ray_token = self.state / "ray" / "auth_token"  # flows/cluster.py: the local Ray head's token
        return {
            **({"SLURM_CONF": str(slurm_conf)} if slurm_conf.exists() else {}),
            **({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_token)} if ray_token.exists() else {}),
            **OFFLINE_DEFAULTS,
            **detached(os.environ),  # the server and worker outlive whoever starts them
            "PREFECT_HOME": str(self.state / "prefect"),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.state / 'prefect.db'}",
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(self.port),
            "SMOLFLOW_ROOT": str(self.root),
            "SMOLFLOW_STATE": str(self.state),
            "PREFECT_SERVER_API_AUTH_STRING": self.auth(),
            "PREFECT_API_AUTH_STRING": self.auth(),
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),  # the relaunch check's sign of life
        }

    # --- processes ------------------------------------------------------------------------

    def _pid_file(self, name: str) -> Path:
        return self.state / f"{name}.pid"

    def pid(self, name: str) -> int | None:
        """The PID of our `name` process if it is alive (and is the process we started)."""
        try:
            proc = Proc.load(json.loads(self._pid_file(name).read_text())).process()
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return proc.pid if proc else None

    def _spawn(self, name: str, command: list[str]) -> int:
        log = os.fdopen(os.open(self.state / f"{name}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
        proc = subprocess.Popen(  # the database, its WAL and journal, Prefect's home: 0600 under the 0700 state dir
            command, env=self.env(), cwd=self.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, umask=PRIVATE_UMASK
        )
        write_private(self._pid_file(name), json.dumps(Proc.of(proc.pid).dump()))
        return proc.pid

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def start(self, timeout_s: float = 180, worker: bool = True, say=print) -> None:
        private_dir(self.state)
        write_private(self.state / "env", self.env_script())
        if self.pid("server") is None:
            if self.healthy():
                raise SmolflowError(f"port {self.port} already has a Prefect server that smolflow did not start; set SMOLFLOW_PORT")
            prefect = str(Path(sys.executable).with_name("prefect"))
            self._spawn("server", [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)])
            say(f"starting the Prefect server (database {self.state / 'prefect.db'}, log {self.state / 'server.log'})")
        deadline = time.time() + timeout_s
        while not self.healthy():
            if self.pid("server") is None:
                raise SmolflowError(f"the Prefect server exited while starting; see {self.state / 'server.log'}")
            if time.time() > deadline:
                raise SmolflowError(
                    f"the Prefect server did not answer on {self.api_url} within {timeout_s:.0f} s; see {self.state / 'server.log'}"
                )
            time.sleep(1)
        self._configure()
        if worker and self.pid("worker") is None:
            prefect = str(Path(sys.executable).with_name("prefect"))
            command = [prefect, "worker", "start", "--pool", POOL, "--type", "process", "--limit", str(sum(QUEUES.values()))]
            # the worker sends the auth string with every poll: it stops with the server, never polls a stranger on the port
            if (server := self.pid("server")) is None:
                raise SmolflowError(f"the Prefect server exited after starting; see {self.state / 'server.log'}")
            self._spawn("worker", guarded(Proc.of(server), command))
            say(f"started a worker on pool {POOL!r} (log {self.state / 'worker.log'})")
        say(f"Prefect UI: {self.ui_url}")

    def _configure(self) -> None:
        """Work pool, queues with their limits, the relaunch check's deployment and the crash automation."""
        code = f"from flows.server import configure; configure({POOL!r}, {QUEUES!r})"
        proc = subprocess.run([sys.executable, "-c", code], env=self.env(), cwd=self.root, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SmolflowError(f"configuring the work pool and automation failed:\n{proc.stderr[-2000:]}")

    def stop(self, say=print) -> None:
        """Workers first (they get SIGTERM twice: a busy worker may ignore the first), then the server."""
        for name in ("worker", "server"):
            pid = self.pid(name)
            if pid is None:
                continue
            proc = psutil.Process(pid)
            group = [proc] + proc.children(recursive=True)
            for _ in range(2):
                for p in group:
                    try:
                        p.send_signal(signal.SIGTERM)
                    except psutil.NoSuchProcess:
                        pass
                _, alive = psutil.wait_procs(group, timeout=15)
                if not alive:
                    break
            for p in alive:
                p.kill()
            self._pid_file(name).unlink(missing_ok=True)
            say(f"stopped the {name} (pid {pid})")

    def status(self) -> dict[str, object]:
        return {
            "server": self.pid("server"),
            "worker": self.pid("worker"),
            "healthy": self.healthy(),
            "ui": self.ui_url,
            "state": str(self.state),
        }

    def owns_port(self) -> bool:
        """Whether what listens on the API port is our server (its process or one of its children): a client checks
        before it sends the auth string, which a local user who bound the port after our server died would receive."""
        ours = self.pid("server")
        if ours is None:
            return False
        family = {ours, *(p.pid for p in psutil.Process(ours).children(recursive=True))}
        listeners = {c.pid for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == self.port}
        return bool(listeners) and listeners <= family  # a pid we may not see (another user's: None) is not ours

    def env_script(self) -> str:
        """Sourced in a shell: the venv, the API's URL and the auth string, which is unset again (with a warning)
        unless the port is our server's when it is sourced."""
        keep = ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "SMOLFLOW_ROOT", "SMOLFLOW_STATE", "SLURM_CONF")
        keep += ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
        keep += tuple(OFFLINE_DEFAULTS)
        env = self.env()
        lines = [f". {self.root / '.venv' / 'bin' / 'activate'}"] + [f"export {k}={env[k]!r}" for k in keep if k in env]
        check = f"PYTHONPATH={str(self.root)!r} {str(self.root / '.venv' / 'bin' / 'python')!r} -m flows.server check-port {self.port}"
        lines.append(f"{check} || unset PREFECT_API_AUTH_STRING")
        return "# source this file to use the local Prefect server from a shell\n" + "\n".join(lines) + "\n"


def temporary_server_of_its_own() -> None:
    """Where no PREFECT_API_URL is set, Prefect starts a temporary API server on a client's first call: make it start in
    a session of its own. In the caller's process group, a Ctrl-C (SIGINT to the terminal's foreground group) or a
    SIGTERM to the group stopped the server together with the flow, and the flow process then retried the dead server
    to report how it ended (73 s after a Ctrl-C of `smolflow stage curate`; a `smolflow run` given SIGTERM was still
    retrying 100 s later). Now the flow reports, ends and stops the server (Prefect's atexit); a killed
    caller's server is reaped, as it carries the caller's tree mark (infra/procs.py)."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # a server of the user's: Prefect's server module (4 CPU s to import) is not needed
        return
    import functools

    from prefect.server.api.server import SubprocessASGIServer

    class OwnSession(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            popen = subprocess.Popen  # Prefect's own command, started with a session of its own
            subprocess.Popen = functools.partial(popen, start_new_session=True)
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen

    OwnSession()  # the instance Prefect's clients find under the default key, not yet started


def configure(pool: str, queues: dict[str, int]) -> None:
    """Runs against PREFECT_API_URL: create what is missing, leave what exists; the automation is replaced."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.utilities.callables import parameter_schema

    from flows.relaunch import relaunch

    flow_name, deployment_name = RELAUNCH.split("/")
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass
        for name, limit in queues.items():
            try:
                queue = client.read_work_queue_by_name(name, work_pool_name=pool)
                client.update_work_queue(queue.id, concurrency_limit=limit)
            except ObjectNotFound:
                client.create_work_queue(name=name, work_pool_name=pool, concurrency_limit=limit)
        deployment_id = client.create_deployment(  # an upsert: same flow and name update the deployment
            flow_id=client.create_flow_from_name(flow_name),
            name=deployment_name,
            description="Started by the crash automation: relaunches a crashed smolflow run if the crash was real (flows/relaunch.py).",
            entrypoint="flows/relaunch.py:relaunch",
            work_pool_name=pool,
            work_queue_name="control",
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $SMOLFLOW_ROOT }}"}}],
            parameter_openapi_schema=parameter_schema(relaunch.fn).model_dump_for_openapi(),
        )
    for name in (AUTOMATION, *OLD_AUTOMATIONS):
        try:
            Automation.read(name=name).delete()
        except ValueError:
            pass
    Automation(
        name=AUTOMATION,
        description=f"Every crash Prefect reports of a run tagged {TAG!r} starts {RELAUNCH} after {GRACE_S} s, which relaunches the run "
        f"(up to {MAX_ATTEMPTS} attempts) only if it really crashed while running; see flows/relaunch.py.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{TAG}"},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        ),
        actions=[
            RunDeployment(
                source="selected",
                deployment_id=deployment_id,
                parameters={"crashed": "{{ event.resource.id }}", "announced": "{{ event.resource['prefect.state-timestamp'] }}"},
                schedule_after=timedelta(seconds=GRACE_S),
            )
        ],
    ).create()


if __name__ == "__main__":  # `python -m flows.server check-port PORT`, as .smolflow/env runs it
    port = int(sys.argv[2])
    if not Server.here(port).owns_port():
        print(f"smolflow: port {port} is not our Prefect server's (stopped? another user's?): the auth string is not set", file=sys.stderr)
        sys.exit(1)
