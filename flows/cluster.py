"""Local clusters on this machine: `smolflow cluster slurm|ray start|stop|status`.

How a user tries the scale-out paths on a laptop, and how the tests get real engines.

Slurm: a single node from Debian's
`slurm-wlm` and `munge` (installed with apt-get when missing and running as root), `munged`, then
`slurmctld` and `slurmd` on one node named after this host, partition `cpu` (the recipe's default
`executor.slurm.partition`). Its configuration, state, logs and PID files live under the project's
state dir (`.smolflow/slurm/`), never in /etc: Slurm's commands find it through `SLURM_CONF`, which
`env()` gives and `.smolflow/env` exports, so a machine's own Slurm configuration is left alone.

Ray: a head node on 127.0.0.1 (no dashboard, no usage stats), found by `ray.init(address="auto")`,
with Ray's token authentication: the token lives in `.smolflow/ray/auth_token` (0600), and only a
process given it (`Ray.env()`, which `.smolflow/env` and the server's worker export) may join and
run tasks as its owner; any other local user is refused.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from infra.env import private_dir, write_private
from infra.errors import SmolflowError
from infra.procs import detached

PACKAGES = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-client", "munged": "munge"}
DAEMONS = ("slurmctld", "slurmd")
DAEMON_UP_S = 10
CONF = """# written by smolflow (flows/cluster.py): a single-node cluster for trying scale-out paths locally
ClusterName=smolflow
SlurmctldHost={host}
SlurmctldPort={port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
# job credentials live 30 s (default 120): a requeued job waits this long before it may start again
AuthInfo=cred_expire=30
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
NodeName={host} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=cpu Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def state_root() -> Path:
    """The project's state dir, as flows/server.py has it: $SMOLFLOW_STATE or ./.smolflow."""
    return Path(os.environ.get("SMOLFLOW_STATE", Path.cwd() / ".smolflow")).resolve()


def missing_commands() -> list[str]:
    return [cmd for cmd in PACKAGES if shutil.which(cmd) is None and not Path("/usr/sbin", cmd).exists()]


def port_taken(port: int) -> str | None:
    """Who holds PORT, or None when a daemon could listen on it (every address, SO_REUSEADDR, as Slurm's daemons bind):
    a daemon that cannot bind its port only says so in its log."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return None
        except OSError:
            pass
    for conn in psutil.net_connections("inet"):
        if conn.laddr and conn.laddr.port == port and conn.pid:
            with contextlib.suppress(psutil.Error):
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    return "another socket"


def free_port_pair() -> int:
    """P with P and P+1 both free, below Linux's ephemeral range (32768 up), where no connection's own port lands: a
    local Slurm cluster listens on both. (A free port + 1 was once an open connection's, and slurmd could not start.)"""
    while True:
        port = random.randrange(20000, 32766)
        if port_taken(port) is None and port_taken(port + 1) is None:
            return port


def _sbin(cmd: str) -> str:
    return shutil.which(cmd) or f"/usr/sbin/{cmd}"


@dataclass(frozen=True)
class Slurm:
    state: Path  # .smolflow/slurm
    port: int = 6817

    @classmethod
    def here(cls) -> Slurm:
        return cls(state=state_root() / "slurm", port=int(os.environ.get("SMOLFLOW_SLURM_PORT", "6817")))

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    def env(self) -> dict[str, str]:
        return {**detached(os.environ), "SLURM_CONF": str(self.conf)}  # its daemons outlive whoever starts them

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise SmolflowError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-1000:]}")
        return proc

    def install(self, say=print) -> None:
        """apt-get the packages of missing commands (as root), or say what is missing."""
        missing = missing_commands()
        if not missing:
            return
        packages = sorted({PACKAGES[cmd] for cmd in missing})
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise SmolflowError(f"Slurm is not installed ({', '.join(missing)} missing); install {' '.join(packages)} (as root) and retry")
        say(f"installing {' '.join(packages)} with apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        proc = subprocess.run(["apt-get", "install", "-y", "-q", *packages], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            proc = subprocess.run(["apt-get", "install", "-y", "-q", *packages], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SmolflowError(f"apt-get install {' '.join(packages)} failed: {proc.stderr.strip()[-1000:]}")

    def _start_munge(self) -> None:
        """munged runs as `munge` with its socket folder and log folder owned by munge (STACK.md)."""
        if any(p.info["name"] == "munged" for p in psutil.process_iter(["name"])):
            return
        for folder in (Path("/run/munge"), Path("/var/log/munge"), Path("/var/lib/munge")):
            folder.mkdir(parents=True, exist_ok=True)
            shutil.chown(folder, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged")], check=True, capture_output=True, timeout=30)

    def pid(self, daemon: str) -> int | None:
        try:
            pid = int((self.state / f"{daemon}.pid").read_text().strip())
            proc = psutil.Process(pid)
            return pid if daemon in proc.name() and proc.status() != psutil.STATUS_ZOMBIE else None
        except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
            return None

    def start(self, timeout_s: float = 120, say=print) -> None:
        if os.geteuid() != 0:
            raise SmolflowError("the local Slurm cluster runs its daemons as root (SlurmUser=root); run as root")
        self.install(say)
        for folder in ("ctld", "spool"):
            (self.state / folder).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        memory_mb = int(psutil.virtual_memory().total / 2**20 * 0.8)
        ports = dict(zip(DAEMONS, (self.port, self.port + 1), strict=True))  # SlurmctldPort, SlurmdPort
        starting = [daemon for daemon in DAEMONS if self.pid(daemon) is None]
        for daemon in starting:
            if (holder := port_taken(ports[daemon])) is not None:
                raise SmolflowError(
                    f"{daemon} cannot listen on port {ports[daemon]}: {holder} holds it; the local cluster takes ports "
                    f"P and P+1 (slurmctld, slurmd): export SMOLFLOW_SLURM_PORT=P with both free (now {self.port})"
                )
        conf = CONF.format(
            host=host, port=ports["slurmctld"], slurmd_port=ports["slurmd"], state=self.state, cpus=os.cpu_count(), memory_mb=memory_mb
        )
        self.conf.write_text(conf)
        self._start_munge()
        for daemon in starting:
            subprocess.run([_sbin(daemon), "-f", str(self.conf)], env=self.env(), check=True, capture_output=True, timeout=60)
            say(f"started {daemon} (log {self.state / daemon}.log)")
        started, deadline = time.time(), time.time() + timeout_s
        while (node := self.node_state()) not in ("idle", "mixed", "allocated"):
            # a daemon writes its pid file once it runs: none by DAEMON_UP_S means it exited, and waiting would only time out
            if time.time() > started + DAEMON_UP_S and (dead := [daemon for daemon in DAEMONS if self.pid(daemon) is None]):
                log = self.state / f"{dead[0]}.log"
                last = log.read_text(errors="replace").strip().splitlines()[-3:] if log.is_file() else ["(no log)"]
                raise SmolflowError(f"{dead[0]} exited while the Slurm node was {node!r}; the end of {log}:\n" + "\n".join(last))
            if time.time() > deadline:
                raise SmolflowError(f"the Slurm node is {node!r} after {timeout_s:.0f} s; see {self.state}/slurmctld.log and slurmd.log")
            if node.startswith("down") or node.startswith("drain"):
                self.run("scontrol", "update", f"NodeName={host}", "State=RESUME", check=False)
            time.sleep(1)
        say(f"Slurm is up: partition cpu on {host}; export SLURM_CONF={self.conf} (`source .smolflow/env` does)")

    def node_state(self) -> str:
        proc = self.run("sinfo", "--noheader", "--format=%T", check=False)
        return proc.stdout.strip().split("\n")[0] if proc.returncode == 0 else "unreachable"

    def stop(self, say=print) -> None:
        """Cancel our jobs, then stop slurmd and slurmctld (munged is shared with other users of munge; left running)."""
        if self.pid("slurmctld") is not None:
            self.run("scancel", "--full", "--partition=cpu", check=False)
        for daemon in reversed(DAEMONS):
            pid = self.pid(daemon)
            if pid is None:
                continue
            proc = psutil.Process(pid)
            proc.terminate()
            _, alive = psutil.wait_procs([proc], timeout=20)
            for p in alive:
                p.kill()
            say(f"stopped {daemon} (pid {pid})")

    def status(self) -> dict[str, object]:
        up = self.pid("slurmctld") is not None
        return {
            "slurmctld": self.pid("slurmctld"),
            "slurmd": self.pid("slurmd"),
            "node": self.node_state() if up else "down",
            "conf": str(self.conf),
            "missing": missing_commands(),
        }

    def jobs(self) -> list[dict]:
        out = self.run("squeue", "--noheader", "--format=%i %j %T", check=False).stdout
        return [dict(zip(("id", "name", "state"), line.split())) for line in out.splitlines() if line.strip()]


@dataclass(frozen=True)
class Ray:
    state: Path  # .smolflow/ray: the head's address
    port: int = 6379

    @classmethod
    def here(cls) -> Ray:
        return cls(state=state_root() / "ray", port=int(os.environ.get("SMOLFLOW_RAY_PORT", "6379")))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def token(self) -> Path:
        return self.state / "auth_token"

    def env(self) -> dict[str, str]:
        """What a process needs to join this head: its address and token (Ray reads both from the environment)."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token)}

    def _ray(self, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        ray = Path(sys.executable).with_name("ray")
        if not ray.exists():
            raise SmolflowError("Ray is not installed in this environment: pip install 'smolflow[cluster]' (make setup installs it)")
        env = {**detached(os.environ), **self.env(), **(env or {})}  # the head outlives whoever starts it
        return subprocess.run([str(ray), *args], env=env, capture_output=True, text=True, timeout=timeout)

    def up(self) -> bool:
        """A closed port answers at once; `ray status` alone waits ~45 s for a GCS that is not there."""
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
        except OSError:
            return False
        proc = self._ray("status", f"--address={self.address}", timeout=60)
        return proc.returncode == 0

    def start(self, say=print) -> None:
        if self.up():
            say(f"Ray is already up at {self.address}")
            return
        private_dir(self.state)
        if not self.token.exists():
            write_private(self.token, secrets.token_hex(32))
        args = ["start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}", f"--num-cpus={os.cpu_count()}"]
        proc = self._ray(*args, "--include-dashboard=false", "--disable-usage-stats", env={"RAY_USAGE_STATS_ENABLED": "0"})
        if proc.returncode != 0:
            raise SmolflowError(f"`ray start` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-1500:]}")
        write_private(self.state / "address", self.address)
        say(
            f"Ray is up at {self.address} (token auth); recipes with executor.kind=ray join it: `source {self.state.parent / 'env'}` "
            f"or export {' '.join(f'{k}={v}' for k, v in self.env().items())}"
        )

    def stop(self, say=print) -> None:
        """`ray stop` ends the Ray processes this user started on this machine."""
        proc = self._ray("stop", timeout=120)
        (self.state / "address").unlink(missing_ok=True)
        say(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "Ray stopped")

    def status(self) -> dict[str, object]:
        return {"address": self.address, "up": self.up()}
