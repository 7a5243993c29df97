"""Curation on a real single-node Slurm cluster (flows/cluster.py): same results as local, failures and time-outs named."""

from __future__ import annotations

import os
import time

import pytest

from flows.cluster import Slurm
from infra.recipe import parse_recipe
from tasks.curation import pipelines
from tests.conftest import free_port
from tests.helpers import micro_recipe
from tests.test_curation import planted, read_ids  # noqa: F401  (planted: the fixture, curated locally)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (its daemons run as root); CI runs as root")
    cluster = Slurm(state=tmp_path_factory.mktemp("slurm"), port=free_port())
    cluster.start(timeout_s=180)
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    yield cluster
    cluster.stop()
    if before is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = before
    assert cluster.pid("slurmctld") is None and cluster.pid("slurmd") is None


def slurm_executor(**changes):
    data = micro_recipe(executor={"kind": "slurm", "tasks": 2, "workers": 2, "slurm": {"mem_per_cpu_gb": 0.5}, **changes})
    return parse_recipe(data, "slurm recipe").executor


def test_curation_on_slurm_keeps_the_same_documents_as_local(slurm, planted, tmp_path):  # noqa: F811
    ex = slurm_executor()
    recipe = planted["recipe"]
    steps = {name: tmp_path / name for name in ("ingest", "filter", "dedup", "decont")}
    pipelines.ingest(recipe.sources, {"web": str(planted["root"] / "raw")}, ex, recipe.storage.s3, False, steps["ingest"])
    pipelines.filter_docs({"web": {}}, ex, steps["ingest"], steps["filter"])
    dedup = pipelines.dedup(recipe.curate.dedup, ex, steps["filter"], steps["dedup"])
    decont = pipelines.decontaminate(recipe.curate.decontaminate, ex, steps["dedup"], steps["decont"])
    for name in steps:
        local = sorted(read_ids(planted["steps"][name] / "data"))
        assert local and sorted(read_ids(steps[name] / "data")) == local, f"{name}: Slurm kept other documents"
    assert (dedup, decont) == (planted["dedup"], planted["decont"])
    assert list((steps["dedup"] / "logs").rglob("slurm_logs/*.out")), "the jobs' Slurm logs are in the step folder"
    assert slurm.jobs() == []


def fail_on_rank_1(data, rank: int = 0, world_size: int = 1):
    if rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    yield from data or []


def sleep_long(data, rank: int = 0, world_size: int = 1):
    time.sleep(120)
    yield from data or []


def test_a_failed_rank_fails_the_task_with_its_log_and_leaves_no_job(slurm, tmp_path):
    with pytest.raises(pipelines.ClusterJobFailed, match=r"1 of 2 tasks incomplete(.|\n)*rank 1 broke on purpose"):
        pipelines.run_pipeline(slurm_executor(), [fail_on_rank_1], tmp_path / "logs", 2, "broken")
    assert slurm.jobs() == []  # the stats merge that waited on the failed array is cancelled too


def test_a_pipeline_past_its_time_budget_fails_and_its_jobs_are_cancelled(slurm, tmp_path):
    started = time.time()
    with pytest.raises(pipelines.ClusterTimeout, match=r"2 of 2 tasks still incomplete after"):
        pipelines.run_pipeline(slurm_executor(timeout_hours=0.002), [sleep_long], tmp_path / "logs", 2, "slow")
    assert time.time() - started < 100  # it gave up before the jobs could finish
    assert slurm.jobs() == []
