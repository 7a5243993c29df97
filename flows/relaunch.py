"""The crash relaunch: put a smolflow flow run that really crashed back in the queue, and only such a run.

Prefect reports crashes that are not: a worker whose submission timed out marks a run Crashed that
then starts and completes; a zombie detector marks a live run Crashed; a run that dies before it
starts (a cron run on a worker that cannot launch it) or while it waits for a retry is reported as
a crash of the same kind. A blind "Crashed -> Scheduled" automation would rerun completed work, start
a second copy of a live run, or loop forever on a run that never starts (its run count never grows).

So the automation (flows/server.py) only starts this check, one flow run per crash report, which
waits out a grace period (two heartbeats) and then relaunches the run only if all of these hold:
it is still in the crash state the report announced; it crashed out of Running (it had started and
was not waiting for a retry); its flow process has sent no heartbeat since; it has attempts left.
Otherwise it says why it left the run alone. Each step's lock still stops two builds of one step
if Prefect's own state changes race this check.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from uuid import UUID

from prefect import flow, get_run_logger

from flows.server import GRACE_S, MAX_ATTEMPTS


def verdict(states: list, run_count: int, announced: datetime, beats_since: int) -> str | None:
    """None when the run should be relaunched, else why not. `states`: the run's states, oldest first."""
    current = states[-1] if states else None
    if current is None or current.type.value != "CRASHED":
        now = current.name if current else "no state"
        return f"it is {now} now, no longer Crashed: the crash report was false or the run was relaunched already"
    if abs((current.timestamp - announced).total_seconds()) > 0.001:
        return "it crashed again since this report; that crash's own check decides"
    before = states[-2] if len(states) > 1 else None
    if before is None or before.type.value != "RUNNING":
        was = before.name if before else "nothing"
        return f"it crashed out of {was}, not Running: it never started (or was awaiting a retry), so there is nothing to resume"
    if beats_since:
        return f"its flow process sent {beats_since} heartbeat(s) since the crash report: it is alive"
    if run_count >= MAX_ATTEMPTS:
        return f"it crashed on attempt {run_count} of {MAX_ATTEMPTS}"
    return None


def heartbeats_since(client, run_id: UUID, since: datetime) -> int:
    window = {"since": since.isoformat(), "until": (datetime.now(since.tzinfo) + timedelta(minutes=1)).isoformat()}
    beats = {"occurred": window, "event": {"name": ["prefect.flow-run.heartbeat"]}, "resource": {"id": [f"prefect.flow-run.{run_id}"]}}
    body = dict(filter=beats, limit=50)  # (a keyword: "filter" is also a step's name, spelled only in flows/graph.py)
    response = client.request("POST", "/events/filter", json=body)
    response.raise_for_status()
    return len(response.json()["events"])


@flow(name="relaunch-crashed", flow_run_name="check {crashed}")
def relaunch(crashed: str, announced: str, grace_s: float = GRACE_S) -> str:
    """Relaunch flow run `crashed` if its crash (state timestamp `announced`) was real; returns the verdict."""
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry

    log = get_run_logger()
    run_id = UUID(crashed.removeprefix("prefect.flow-run."))
    at = datetime.fromisoformat(announced)
    time.sleep(max(0.0, grace_s - (datetime.now(at.tzinfo) - at).total_seconds()))
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        states = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
        why = verdict(states, run.run_count, at, heartbeats_since(client, run_id, at))
        if why is not None:
            log.info("left flow run %s (%s) alone: %s", run.name, run_id, why)
            return f"left alone: {why}"
        state = AwaitingRetry(scheduled_time=datetime.now(at.tzinfo), message=f"relaunched after a crash (attempt {run.run_count + 1})")
        result = client.set_flow_run_state(run_id, state)
        log.info("relaunched flow run %s (%s): %s", run.name, run_id, result.status.value)
        return f"relaunched: {result.status.value}"
