"""Step identity, caching, atomic commits, one layout (STORE/NAME-ID linked from RUN/NAME), statuses and the frozen recipe."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from infra.errors import DiskFull, SmolflowError, UpstreamMissing
from infra.recipe import Strict, operational
from infra.steps import (
    CARD,
    FINAL,
    JOB,
    MANIFEST,
    METRICS,
    PARTIAL,
    STEPS,
    TRL_ARGS,
    Run,
    Step,
    SummaryMismatch,
    fingerprint_tree,
    finished,
    identity,
    require,
    run_step,
    statuses,
    step_id,
)
from infra.summaries import Closed, PhaseSummary, read_summary
from tests.helpers import REPO, built_folders, micro_recipe, write_recipe


class Cfg(Strict):
    v: int = 0
    threads: int = operational(1)


def step(name: str, calls: list, text: str = "", deps: dict | None = None, **config) -> Step:
    """A step whose output is `text` (or its config and inputs), recording each build in `calls`."""

    def build(cfg, inputs, out: Path) -> dict:
        calls.append(name)
        (out / "data.txt").write_text(text or json.dumps([identity(cfg), {k: v.fingerprint for k, v in inputs.items()}]))
        return {"v": cfg.v}

    return Step(name, "test", build, Cfg(**config), deps or {})


def test_unchanged_step_is_skipped_and_changed_config_reruns(tmp_path):
    calls: list = []
    first = run_step(tmp_path, step("a", calls, v=1), {})
    again = run_step(tmp_path, step("a", calls, v=1), {})
    assert calls == ["a"] and again.cached and again.fingerprint == first.fingerprint
    changed = run_step(tmp_path, step("a", calls, v=2), {})
    assert calls == ["a", "a"] and not changed.cached
    assert json.loads((tmp_path / "a" / MANIFEST).read_text())["summary"] == {"v": 2}


def test_operational_fields_are_no_part_of_identity():
    assert identity(Cfg(v=1, threads=8)) == {"v": 1}
    calls: list = []
    assert step("a", calls, v=1, threads=1).step_id({}) == step("a", calls, v=1, threads=16).step_id({})
    assert step("a", calls, v=1).step_id({}) != step("a", calls, v=2).step_id({})


def test_downstream_reruns_only_when_upstream_content_changes(tmp_path):
    calls: list = []
    up = run_step(tmp_path, step("up", calls, "same", v=1), {})
    down = run_step(tmp_path, step("down", calls, "d", deps={"x": step("up", calls)}), {"x": up})
    top = run_step(tmp_path, step("top", calls, "t"), {"y": down})
    assert top.lineage == {"up": up.step_id, "down": down.step_id}, "every upstream step, however far, with the id that built it"
    assert json.loads((tmp_path / "top" / MANIFEST).read_text())["lineage"] == [["up", up.step_id], ["down", down.step_id]]
    # upstream rebuilt with a new config but identical output: downstream stays cached
    up2 = run_step(tmp_path, step("up", calls, "same", v=2), {})
    assert up2.fingerprint == up.fingerprint
    assert run_step(tmp_path, step("down", calls, "d"), {"x": up2}).cached
    up3 = run_step(tmp_path, step("up", calls, "different", v=3), {})
    down3 = run_step(tmp_path, step("down", calls, "d"), {"x": up3})
    assert not down3.cached and down3.step_id != down.step_id


def test_a_step_that_reads_part_of_an_input_keeps_its_id_when_only_the_rest_changes(tmp_path):
    """`reads`: a pretraining phase that draws on prose alone (a swarm proxy that left math out) is not built again
    when math's tokens change; a step that reads math, or all of the input, is."""
    calls: list = []

    def tokens(math: str) -> Step:
        def build(cfg, inputs, out: Path) -> dict:
            for source, text in (("prose", "p"), ("math", math)):
                (out / "data" / source).mkdir(parents=True)
                (out / "data" / source / "00000.bin").write_text(text)
            return {}

        return Step("tokens", "test", build, Cfg(v=len(math)))

    def reader(name: str, *folders: str) -> Step:
        return dataclasses.replace(step(name, calls, name, deps={"tokens": tokens("")}), reads=lambda cfg: {"tokens": folders})

    readers = [reader("prose_only", "data/prose/"), reader("both", "data/prose/", "data/math/"), step("whole", calls, "w")]
    first = run_step(tmp_path, tokens("m"), {})
    ids = {s.name: run_step(tmp_path, s, {"tokens": first}).step_id for s in readers}
    changed = run_step(tmp_path, tokens("mm"), {})
    calls.clear()
    again = {s.name: run_step(tmp_path, s, {"tokens": changed}) for s in readers}
    assert calls == ["both", "whole"] and again["prose_only"].cached
    assert again["prose_only"].step_id == ids["prose_only"] and again["both"].step_id != ids["both"]
    gate = reader("gate")  # reads nothing of it: an order, not data
    assert gate.step_id({"tokens": first}) == gate.step_id({"tokens": changed})


def test_a_rebuild_elsewhere_with_the_same_outputs_gives_the_steps_downstream_the_same_ids(tmp_path):
    """A trainer's traces (its job with this machine's paths, metrics and summary with times, the model card, TRL's
    pickled arguments) are no part of what a step hands downstream: a phase rebuilt in another store or run dir
    with the same weights gives the next phase the same id, so a mirror's copy of it is pulled, not trained again."""
    built = []
    for where in ("here", "there"):

        def train(cfg, inputs, out: Path, where=where) -> dict:
            (out / FINAL).mkdir()
            (out / FINAL / "model.safetensors").write_bytes(b"the same weights")
            (out / FINAL / CARD).write_text(f"trained in {time.time()} s")
            (out / FINAL / TRL_ARGS).write_bytes(str(out).encode())
            (out / JOB).write_text(json.dumps({"data": str(tmp_path / where / "tokenize")}))
            (out / METRICS).write_text(json.dumps({"tokens_per_s": time.time()}))
            return {}

        built.append(run_step(tmp_path / where, Step("phase", "test", train, Cfg()), {}))
    assert built[0].fingerprint == built[1].fingerprint
    following = step("next", [], "n")
    assert following.step_id({"x": built[0]}) == following.step_id({"x": built[1]})
    (built[1].path / FINAL / "model.safetensors").write_bytes(b"other weights")
    assert fingerprint_tree(built[1].path) != built[0].fingerprint, "the weights are what it hands downstream"


def test_a_full_disk_fails_a_step_or_a_result_naming_the_folder_and_its_free_space_and_spares_what_was_committed(small_disk):
    from tasks.evaluation.results import ModelRef, ResultStore

    disk, calls = small_disk(256 * 1024), []
    done = run_step(disk, step("small", calls, "x" * 1000), {})
    with pytest.raises(
        DiskFull, match=r"step big: no space left writing \S+/\.partial/big-\w+ \(0\.\d MiB free there\); its partial build"
    ):
        run_step(disk, step("big", calls, "y" * 2**20), {})
    assert fingerprint_tree(done.path) == json.loads((done.path / MANIFEST).read_text())["fingerprint"]
    assert run_step(disk, step("small", calls, "x" * 1000), {}).cached and calls == ["small", "big"]

    shutil.rmtree(disk / STEPS / PARTIAL)  # room for a result, then a larger one that does not fit
    results, model = ResultStore(str(disk / "results")), ModelRef("m", "f1", "base", "model", "base")
    first = results.put(model, {"t": {"acc": 0.5}}, {"t": "k"}, None, 1.0)
    with open(disk / "filler", "wb") as filler, contextlib.suppress(OSError):
        filler.write(b"0" * 2**20)
    with pytest.raises(DiskFull, match=r"evaluation results: no space left writing .*\.f1\.t\.k\.json\.\w+\.tmp \(0\.\d MiB free there\)"):
        results.put(model, {"t": {"acc": 0.7, "items": [[1.0, 1.0]] * 50_000}}, {"t": "k"}, None, 1.0)  # the same result again
    assert results.get("f1") == first and not list((disk / "results").glob(".*.tmp"))


def test_a_trainer_out_of_disk_ends_its_task_as_disk_full_naming_the_folder_whatever_its_writer_said(small_disk, tmp_path):
    """A rank's failed write marks the step folder (launchers report any failed rank as exit 1), and the task turns the
    mark into DiskFull, not a retried TrainerFailed: torch.save's error says nothing of the disk, safetensors' does."""
    import torch
    from safetensors.torch import save_file

    from infra.errors import TrainerFailed
    from infra.launch import DISK_FULL_MARK, Tail, before_launch, check_disk, check_exit, mark_disk_full
    from infra.procs import PREEMPTED

    out = tmp_path / "step"
    out.mkdir()
    done, tail = out / "result.json", Tail(lambda line: None)
    mark_disk_full(ValueError("a bug"), out, [out])  # not a disk: the retry stays
    assert not (out / DISK_FULL_MARK).exists()
    with pytest.raises(TrainerFailed, match="sft: the trainer exited with code 1 before finishing"):
        check_exit("sft", 1, out, [out], done, tail)

    full = small_disk(256 * 1024)
    with pytest.raises(RuntimeError) as raised:
        torch.save({"w": torch.zeros(2**17)}, full / "ckpt.pt")  # 512 KiB
    assert "space" not in str(raised.value)
    mark_disk_full(raised.value, out, [full, out])
    with pytest.raises(DiskFull, match=rf"pretrain phase1: the trainer ran out of disk: {full}: 0\.0 MiB free \(RuntimeError"):
        check_exit("pretrain phase1", 1, out, [full, out], done, tail)
    with pytest.raises(TrainerFailed, match="checkpointed and exited; a retry resumes"):  # a signal's exit, not the disk
        check_exit("pretrain phase1", PREEMPTED, out, [full, out], done, tail)

    done.write_text("{}")  # an earlier attempt's result and mark: the next launch must not read them
    before_launch(out, done)
    assert not done.exists() and not (out / DISK_FULL_MARK).exists()
    with pytest.raises(TrainerFailed, match="exited with code 0 before finishing"):
        check_exit("sft", 0, out, [out], done, tail)
    done.write_text("{}")
    check_exit("sft", 0, out, [out], done, tail)  # finished: nothing raised
    roomy = small_disk(3 * 2**20)
    with pytest.raises(Exception, match="No space left on device") as raised:
        save_file({"w": torch.zeros(2**20)}, roomy / "model.safetensors")  # 4 MiB
    assert shutil.disk_usage(roomy).free > 2**20, "only the error says the disk was full"
    mark_disk_full(raised.value, out, [roomy])
    with pytest.raises(DiskFull, match=rf"sft: the trainer ran out of disk: {roomy}: [23]\.\d MiB free \(SafetensorError"):
        check_disk("sft", out, [roomy])

    inside = full / "step"  # the mark itself finds no room: the task sees the disk
    inside.mkdir()
    mark_disk_full(raised.value, inside, [inside])
    assert not (inside / DISK_FULL_MARK).exists()
    with pytest.raises(DiskFull, match=rf"apo: the trainer ran out of disk: {inside}: 0\.0 MiB free\. The checkpoints"):
        check_disk("apo", inside, [inside])


def test_failed_build_leaves_no_finished_step(tmp_path):
    def crash(cfg, inputs, out):
        (out / "half.txt").write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_step(tmp_path, Step("a", "test", crash, Cfg()), {})
    assert not (tmp_path / "a").exists()
    calls: list = []
    out = run_step(tmp_path, step("a", calls), {})
    assert calls == ["a"] and not out.cached


def test_partial_of_same_step_is_resumed_and_of_another_id_kept(tmp_path):
    def crash(cfg, inputs, out):
        (out / f"shard-v{cfg.v}").write_text("done")
        raise RuntimeError("killed after a shard")

    seen = []

    def resume(cfg, inputs, out):
        seen.append(sorted(p.name for p in out.iterdir() if p.name.startswith("shard")))
        return {}

    with pytest.raises(RuntimeError):
        run_step(tmp_path, Step("a", "test", crash, Cfg(v=1)), {})
    run_step(tmp_path, Step("a", "test", resume, Cfg(v=1, threads=4)), {})  # only an operational change: same id
    assert seen == [["shard-v1"]]

    with pytest.raises(RuntimeError):
        run_step(tmp_path, Step("b", "test", crash, Cfg(v=1)), {})
    with pytest.raises(RuntimeError):
        run_step(tmp_path, Step("b", "test", crash, Cfg(v=2)), {})  # another identity: another partial folder
    sid1 = Step("b", "test", crash, Cfg(v=1)).step_id({})
    assert (tmp_path / STEPS / PARTIAL / f"b-{sid1}" / "shard-v1").is_file(), "work of another identity is kept, never deleted"
    seen.clear()
    run_step(tmp_path, Step("b", "test", resume, Cfg(v=1)), {})  # back to v1: its partial build resumes
    assert seen == [["shard-v1"]]


def test_every_version_stays_in_the_store_and_the_run_links_the_one_it_uses(tmp_path):
    calls: list = []
    v1 = run_step(tmp_path, step("a", calls, "one", v=1), {})
    v2 = run_step(tmp_path, step("a", calls, "two", v=2), {})
    assert (tmp_path / STEPS / f"a-{v1.step_id}" / "data.txt").read_text() == "one"
    assert (tmp_path / "a").is_symlink() and (tmp_path / "a").readlink() == Path(STEPS) / f"a-{v2.step_id}"
    back = run_step(tmp_path, step("a", calls, "one", v=1), {})
    assert calls == ["a", "a"] and back.cached and (tmp_path / "a" / "data.txt").read_text() == "one"
    assert sorted(p.name for p in (tmp_path / STEPS).iterdir() if not p.name.startswith(".")) == sorted(
        [f"a-{v1.step_id}", f"a-{v2.step_id}", "builds.jsonl"]
    )


def test_a_real_folder_where_the_run_links_a_step_is_never_overwritten(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "data.txt").write_text("someone's")
    with pytest.raises(SmolflowError, match="is a folder, not a link"):
        run_step(tmp_path, step("a", [], "fresh"), {})
    assert (tmp_path / "a" / "data.txt").read_text() == "someone's"


def test_step_id_depends_on_config_and_inputs_only():
    assert step_id("a", {"x": 1, "y": 2}, {"i": "f"}) == step_id("a", {"y": 2, "x": 1}, {"i": "f"})
    assert step_id("a", {"x": 1}, {"i": "f"}) != step_id("a", {"x": 1}, {"i": "g"})


def test_statuses_name_changed_keys_and_missing_upstream_says_what_to_run(tmp_path):
    calls: list = []
    up = step("up", calls, v=1)
    down = step("down", calls, deps={"x": up})
    with pytest.raises(UpstreamMissing, match="needs the output of step 'up'.*smolflow stage test"):
        require(tmp_path, statuses(tmp_path, [up])[0], needed_by="down")
    run_step(tmp_path, down, {"x": run_step(tmp_path, up, {})})
    assert [s.state for s in statuses(tmp_path, [up, down])] == ["cached", "cached"]
    up2 = step("up", calls, v=2)
    changed = statuses(tmp_path, [up2, step("down", calls, deps={"x": up2})])
    assert [(s.state, s.changes) for s in changed] == [("rerun", [("v", 1, 2)]), ("rerun", [])]
    assert changed[1].reason == "after up"
    with pytest.raises(UpstreamMissing, match=r"out of date with the recipe \(v: 1 -> 2\)"):
        require(tmp_path, changed[0], needed_by="down")


def test_a_run_freezes_its_recipe_and_relaunches_read_it(tmp_path):
    """A YAML edited after the run started changes nothing for stages that read the run dir or relaunch."""
    path = write_recipe(tmp_path / "r.yaml", micro_recipe())
    first = Run.open(str(path), str(tmp_path / "run"), owner="flow-run-1")
    write_recipe(path, micro_recipe(**{"postrain.apo.beta": 0.5}))  # edited mid-run
    assert Run.open(None, str(tmp_path / "run")).recipe == first.recipe  # a stage flow of the pipeline
    assert Run.open(str(path), str(tmp_path / "run"), owner="flow-run-1").recipe == first.recipe  # a retry or crash relaunch
    frozen = json.loads((tmp_path / "run" / "recipe.json").read_text())
    assert frozen["postrain"]["apo"]["beta"] == 0.1
    changed = Run.open(str(path), str(tmp_path / "run"), owner="flow-run-2")  # a new run of the edited recipe: explicit
    assert changed.changes == (("postrain.apo.beta", 0.1, 0.5),) and changed.recipe.postrain.apo.beta == 0.5


HOLD_RUN = """
import sys, time
from infra.steps import Run
run = Run.open(sys.argv[1], sys.argv[2], owner="pipeline")
print("open", flush=True)
time.sleep(600)
"""


def test_a_run_given_a_recipe_refuses_another_recipe_for_its_run_dir_until_it_ends(tmp_path):
    """`smolflow stage sft RECIPE --run-dir D` while D's pipeline runs would re-freeze D/recipe.json, and the pipeline's
    later stages would adopt it: the pipeline's process holds D's recipe lock, a stage without a recipe is welcome."""
    import subprocess
    import sys

    path, run_dir = write_recipe(tmp_path / "r.yaml", micro_recipe()), tmp_path / "run"
    pipeline = subprocess.Popen([sys.executable, "-c", HOLD_RUN, str(path), str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert pipeline.stdout.readline() == "open\n"
        edited = write_recipe(tmp_path / "edited.yaml", micro_recipe(**{"postrain.apo.beta": 0.5}))
        with pytest.raises(SmolflowError, match=rf"in use by a run given its recipe \(.*pid {pipeline.pid}"):
            Run.open(str(edited), str(run_dir))
        assert Run.open(None, str(run_dir)).recipe.postrain.apo.beta == 0.1  # a stage on the frozen recipe
        assert Run.open(str(edited), str(run_dir), freeze=False).changes  # a dry run says what would change
    finally:
        pipeline.kill()
        pipeline.wait()
    first = Run.open(str(edited), str(run_dir))  # its holder gone, the lock is free
    again = Run.open(str(edited), str(run_dir))  # this process's own runs (an ablation's threads) share the hold
    first.close()
    again.close()
    assert json.loads((run_dir / "recipe.json").read_text())["postrain"]["apo"]["beta"] == 0.5


def test_runs_sharing_a_store_build_a_step_once_even_at_the_same_time(tmp_path):
    """An ablation's runs: RUN/steps links to one store, a step lives in STORE/NAME-ID; a second builder waits."""
    import threading
    import time

    store, calls = tmp_path / "steps", []
    store.mkdir()
    for run in ("r1", "r2", "r3"):
        (tmp_path / run).mkdir()
        (tmp_path / run / STEPS).symlink_to(store)

    def slow(cfg, inputs, out: Path) -> dict:
        calls.append(threading.current_thread().name)
        time.sleep(0.5)  # long enough for the other run to arrive while it builds
        (out / "data.txt").write_text("x")
        return {}

    shared = Step("a", "test", slow, Cfg(v=1))
    outputs = {}

    def build(run: str) -> None:
        outputs[run] = run_step(tmp_path / run, shared, {})

    runs = [threading.Thread(target=build, args=(r,), name=r) for r in ("r1", "r2")]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert len(calls) == 1 and sorted(o.cached for o in outputs.values()) == [False, True]
    folder = store / f"a-{shared.step_id({})}"
    assert (tmp_path / "r1" / "a").resolve() == (tmp_path / "r2" / "a").resolve() == folder.resolve()
    assert built_folders(store) == [folder.name]
    # another identity in one run: a second store folder, the first one kept for the other run
    other = run_step(tmp_path / "r2", Step("a", "test", slow, Cfg(v=2)), {})
    assert not other.cached and len(calls) == 2 and folder.is_dir()
    assert (tmp_path / "r1" / "a" / "data.txt").read_text() == "x"
    assert statuses(tmp_path / "r3", [shared])[0].state == "cached"  # a new run finds it in the store


def test_a_recipe_can_share_a_project_wide_store(tmp_path, monkeypatch):
    """`storage.store`: runs of any recipe link RUN/steps to it, so a step built by one is cached for the next."""
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path / "r.yaml", micro_recipe(**{"storage.store": "runs/steps"}))
    first = Run.open(str(path), "runs/one")
    calls: list = []
    first.build(step("a", calls, v=1), {})
    second = Run.open(str(path), "runs/two", freeze=False)
    assert [s.state for s in second.statuses([step("a", calls, v=1)])] == ["cached"], "a dry run sees the shared store"
    second = Run.open(str(path), "runs/two")
    assert second.build(step("a", calls, v=1), {}).cached and calls == ["a"]
    assert (tmp_path / "runs" / "two" / STEPS).resolve() == (tmp_path / "runs" / "steps").resolve()
    first.close()
    second.close()


def test_a_run_dir_of_the_old_layout_is_converted_in_place_without_rebuilding(tmp_path):
    """RUN/NAME folders, RUN/.previous/NAME-ID[.partial] and RUN/.partial/NAME (+ .step_id), as smolflow made them
    before the one layout: opened once, every version is in the store, the run links what it used, nothing rebuilds."""
    path = write_recipe(tmp_path / "r.yaml", micro_recipe())
    calls: list = []
    scratch = tmp_path / "scratch"
    v1 = run_step(scratch, step("a", calls, "one", v=1), {})
    v2 = run_step(scratch, step("a", calls, "two", v=2), {})
    run = tmp_path / "run"
    (run / ".previous").mkdir(parents=True)
    (run / ".partial" / "b").mkdir(parents=True)
    os.replace(scratch / STEPS / f"a-{v2.step_id}", run / "a")  # the finished step the run used
    os.replace(scratch / STEPS / f"a-{v1.step_id}", run / ".previous" / f"a-{v1.step_id}")  # a version moved aside
    sid_b = step("b", [], v=3).step_id({})
    (run / ".partial" / "b" / ".step_id").write_text(sid_b)
    (run / ".partial" / "b" / "shard0").write_text("half")  # a partial build
    Run.open(str(path), str(run))
    assert (run / "a").is_symlink() and (run / "a" / "data.txt").read_text() == "two"
    assert (run / STEPS / f"a-{v1.step_id}" / "data.txt").read_text() == "one"
    assert not (run / ".previous").exists()
    seen = []
    run_step(run, Step("b", "test", lambda cfg, inputs, out: seen.append(sorted(p.name for p in out.iterdir())) or {}, Cfg(v=3)), {})
    assert seen == [["shard0"]], "the partial build resumes in the store"
    assert run_step(run, step("a", calls, "two", v=2), {}).cached and run_step(run, step("a", calls, "one", v=1), {}).cached
    assert calls == ["a", "a"], "nothing was built again"


def test_an_ablation_run_of_the_old_layout_keeps_its_shared_steps(tmp_path):
    """An ablation's run linked its steps through RUN/.store (a link to ABLATION/steps): after the conversion its
    store link is RUN/steps and every step link goes through it, so nothing is rebuilt or lost."""
    store = tmp_path / "abl" / "steps"
    calls: list = []
    first = run_step(tmp_path / "abl" / "scratch", step("a", calls, "shared"), {})
    store.mkdir(parents=True)
    os.replace(tmp_path / "abl" / "scratch" / STEPS / first.folder, store / first.folder)
    run = tmp_path / "abl" / "apo-seed0"
    run.mkdir()
    (run / ".store").symlink_to("../steps")
    (run / "a").symlink_to(f".store/{first.folder}")
    write_recipe(tmp_path / "r.yaml", micro_recipe())
    Run.open(str(tmp_path / "r.yaml"), str(run))
    assert (run / STEPS).readlink() == Path("../steps") and (run / "a").readlink() == Path(STEPS) / first.folder
    assert (run / "a" / "data.txt").read_text() == "shared" and run_step(run, step("a", calls, "shared"), {}).cached and calls == ["a"]


# --- typed summaries --------------------------------------------------------------------------


class Counted(Closed):
    docs: int


def counted(name: str, calls: list, returns) -> Step:
    """A step that declares its summary model (Counted) and returns RETURNS."""

    def build(cfg, inputs, out: Path) -> Counted:
        calls.append(name)
        (out / "data.txt").write_text("x")
        return returns

    return Step(name, "test", build, Cfg(), {})


def test_a_summary_is_checked_against_the_model_its_function_declares_before_the_commit(tmp_path):
    calls: list = []
    with pytest.raises(SummaryMismatch, match=r"(?s)step a: its summary does not match Counted/1.*docs"):
        run_step(tmp_path, counted("a", calls, {"documents": 3}), {})  # a renamed key
    assert calls == ["a"] and not (tmp_path / "a").exists(), "nothing committed"
    out = run_step(tmp_path, counted("b", calls, Counted(docs=3)), {})
    assert isinstance(out.summary, Counted) and out.summary.docs == 3
    manifest = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert manifest["summary_schema"] == "Counted/1" and manifest["summary"] == {"docs": 3}
    again = run_step(tmp_path, counted("b", calls, None), {})
    assert again.cached and isinstance(again.summary, Counted) and again.summary.docs == 3, "read back as the model it was written with"


def test_a_manifest_from_a_newer_schema_is_refused_and_one_from_before_schemas_reads_as_its_model(tmp_path):
    calls: list = []
    run_step(tmp_path, counted("b", calls, Counted(docs=3)), {})
    path = tmp_path / "b" / MANIFEST
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps(manifest | {"summary_schema": "Counted/2"}))
    with pytest.raises(ValueError, match=r"manifest.json: summary schema Counted/2 is unknown to this code \(Counted/1\)"):
        finished(tmp_path, counted("b", calls, None))
    legacy = {k: v for k, v in manifest.items() if k != "summary_schema"}
    path.write_text(json.dumps(legacy))
    out = finished(tmp_path, counted("b", calls, None))
    assert isinstance(out.summary, Counted) and out.summary.docs == 3
    # a pre-schema phase manifest read without its step: the one declared model that accepts it
    phase = {"phase": "p1", "steps": 3, "tokens": 96, "seq_len": 32, "final_loss": 4.0, "stopped_early": False}
    phase |= {"dropped_steps": [], "failed_uploads": [], "checkpoint_seconds": None}
    assert isinstance(read_summary(phase, None, "m"), PhaseSummary)
    with pytest.raises(ValueError):
        read_summary({k: v for k, v in phase.items() if k != "phase"}, "PhaseSummary/1", "m")  # a missing field fails where it is read


def test_every_step_of_the_pipeline_declares_a_closed_summary_model():
    from flows.graph import build_graph
    from infra.recipe import load_recipe

    graph = build_graph(load_recipe(REPO / "configs" / "tiny.yaml"))
    open_ones = [s.name for s in graph.steps if not issubclass(s.summary_type, Closed)]
    assert not open_ones, f"steps whose function names no summary model: {open_ones}"


def test_a_step_wired_to_roles_its_function_does_not_take_fails_where_the_graph_is_built():
    from flows.graph import build_graph
    from infra.recipe import load_recipe
    from tasks import curate

    graph = build_graph(load_recipe(REPO / "configs" / "tiny.yaml"))
    docs = graph.curation["decontaminated"]
    with pytest.raises(ValueError, match=r"step tokenize: its inputs \['docs'\] do not match .*DocsAndTokenizer: \['bpe', 'docs'\]"):
        Step("tokenize", "curate", curate.tokenize, Cfg(), {"docs": docs})
    with pytest.raises(ValueError, match=r"step dedup: its inputs \['docs', 'extra'\]"):
        Step("dedup", "curate", curate.dedup, Cfg(), {"docs": docs, "extra": docs})
    assert Step("tokenizer", "curate", curate.train_tokenizer, Cfg(), {}).deps == {}, "an optional role may be left out"
