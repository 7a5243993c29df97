"""Curation on a real single-node Slurm cluster and a real Ray head (flows/cluster.py): the same documents as local,
failed ranks and time-outs named, no job left behind."""

from __future__ import annotations

import os
import time

import pytest

from flows.cluster import Ray, Slurm
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


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    head = Ray(state=tmp_path_factory.mktemp("ray"), port=free_port())
    head.start()
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = head.address
    yield head
    import ray

    ray.shutdown()
    head.stop()
    if before is None:
        os.environ.pop("RAY_ADDRESS")
    else:
        os.environ["RAY_ADDRESS"] = before
    assert not head.up()


def cluster_executor(kind: str, **changes):
    data = micro_recipe(executor={"kind": kind, "tasks": 2, "workers": 2, "slurm": {"mem_per_cpu_gb": 0.5}, **changes})
    return parse_recipe(data, f"{kind} recipe").executor


def slurm_executor(**changes):
    return cluster_executor("slurm", **changes)


def curate_and_compare(ex, local, tmp_path):
    recipe = local["recipe"]
    steps = {name: tmp_path / name for name in ("ingest", "filter", "dedup", "decont")}
    pipelines.ingest(recipe.sources, {"web": str(local["root"] / "raw")}, ex, recipe.storage.s3, False, steps["ingest"])
    pipelines.filter_docs({"web": {}}, ex, steps["ingest"], steps["filter"])
    dedup = pipelines.dedup(recipe.curate.dedup, ex, steps["filter"], steps["dedup"])
    decont = pipelines.decontaminate(recipe.curate.decontaminate, ex, steps["dedup"], steps["decont"])
    for name in steps:
        kept = sorted(read_ids(local["steps"][name] / "data"))
        assert kept and sorted(read_ids(steps[name] / "data")) == kept, f"{name}: {ex.kind} kept other documents than local"
    assert (dedup, decont) == (local["dedup"], local["decont"])
    return steps


def test_curation_on_slurm_keeps_the_same_documents_as_local(slurm, planted, tmp_path):  # noqa: F811
    steps = curate_and_compare(slurm_executor(), planted, tmp_path)
    assert list((steps["dedup"] / "logs").rglob("slurm_logs/*.out")), "the jobs' Slurm logs are in the step folder"
    assert slurm.jobs() == []


def test_curation_on_ray_keeps_the_same_documents_as_local(ray_head, planted, tmp_path):  # noqa: F811
    curate_and_compare(cluster_executor("ray"), planted, tmp_path)


def test_a_failed_ray_task_fails_the_task_with_its_log(ray_head, tmp_path):
    with pytest.raises(pipelines.ClusterJobFailed, match=r"1 of 2 tasks incomplete(.|\n)*rank 1 broke on purpose"):
        pipelines.run_pipeline(cluster_executor("ray"), [fail_on_rank_1], tmp_path / "logs", 2, "broken")


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
