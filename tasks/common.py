"""What every Prefect task of the project shares: retries that skip user errors, logging, and the task
that builds a step (one Prefect task run per step, named after it)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from infra.errors import SmolflowError
from infra.steps import Run, Step, StepOutput


def retry_unless_user_error(task, task_run, state) -> bool:
    """Retry crashes and transient faults; a bad recipe or bad input fails the same way every time."""
    exc = state.data
    return not (isinstance(exc, SmolflowError) and not exc.retryable)


def stage_task(name: str, retries: int = 2):
    """A task whose caching is done by step fingerprints (infra/steps.py), never by Prefect's input hashing."""
    options = {"name": name, "retries": retries, "retry_delay_seconds": [5, 30, 120][:retries] or 0}
    return lambda fn: DeferredTask(fn, options)


class DeferredTask:
    """A Prefect task made on its first use. Every CLI command imports the modules that define tasks (through the
    graph), and a command that only reads the recipe (`smolflow validate`, `plan`, a dry run, a refusal) needs no
    Prefect (with pandas): `smolflow validate` took 5.3 CPU s with it, 2.3 without (bench/cli.py)."""

    def __init__(self, fn, options: dict) -> None:
        self.fn, self.options = fn, options
        functools.update_wrapper(self, fn)

    @functools.cached_property
    def task(self):
        from prefect import task
        from prefect.cache_policies import NO_CACHE

        return task(**self.options, retry_condition_fn=retry_unless_user_error, cache_policy=NO_CACHE)(self.fn)

    def __call__(self, *args, **kwargs):
        return self.task(*args, **kwargs)

    def __getattr__(self, name: str):  # with_options, submit, name...: the task's own
        if name in ("fn", "options", "task"):  # not set yet (unpickling, copying): never the task's
            raise AttributeError(name)
        return getattr(self.task, name)


TRACKIO = "trackio"  # RUN_DIR/trackio: trackio's database of every trainer's curves (`smolflow dashboard RUN_DIR`)


def tracking_env(run_dir: Path) -> dict[str, str]:
    """What points a trainer's trackio at its run's folder (trackio reads it when imported)."""
    return {"TRACKIO_DIR": str((Path(run_dir) / TRACKIO).resolve())}


def tracking_project(name: str) -> str:
    """The trackio project of the recipe NAME: pretraining's phases and post-training's trainers are its runs."""
    return f"smolflow-{name}"


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("smolflow")


@stage_task("step")
def _build(run: Run, step: Step, inputs: dict[str, StepOutput]) -> StepOutput:
    return run.build(step, inputs)


def build(run: Run, step: Step, inputs: dict[str, StepOutput]) -> StepOutput:
    """Build `step` (or find it finished) in a Prefect task run named after it."""
    return _build.with_options(name=step.name, task_run_name=step.name)(run, step, inputs)
