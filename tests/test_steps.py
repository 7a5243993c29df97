"""Step identity, caching and atomic commits (infra/steps.py)."""

from __future__ import annotations

import json

import pytest

from infra.errors import UpstreamMissing
from infra.steps import MANIFEST, load_step, run_step, step_id


def writer(text: str, calls: list):
    def build(out):
        calls.append(text)
        (out / "data.txt").write_text(text)
        return {"chars": len(text)}

    return build


def test_unchanged_step_is_skipped_and_changed_config_reruns(tmp_path):
    calls: list = []
    first = run_step(tmp_path, "a", {"p": 1}, {"src": "f1"}, writer("one", calls))
    again = run_step(tmp_path, "a", {"p": 1}, {"src": "f1"}, writer("one", calls))
    assert calls == ["one"] and again.cached and again.fingerprint == first.fingerprint
    changed = run_step(tmp_path, "a", {"p": 2}, {"src": "f1"}, writer("two", calls))
    assert calls == ["one", "two"] and not changed.cached
    assert (tmp_path / "a" / "data.txt").read_text() == "two"
    assert json.loads((tmp_path / "a" / MANIFEST).read_text())["summary"] == {"chars": 3}


def test_downstream_reruns_only_when_upstream_content_changes(tmp_path):
    calls: list = []
    up = run_step(tmp_path, "up", {"v": 1}, {}, writer("same", calls))
    down = run_step(tmp_path, "down", {}, {"up": up}, writer("d", calls))
    # upstream rebuilt with a new config but identical output: downstream stays cached
    up2 = run_step(tmp_path, "up", {"v": 2}, {}, writer("same", calls))
    assert up2.fingerprint == up.fingerprint
    assert run_step(tmp_path, "down", {}, {"up": up2}, writer("d", calls)).cached
    up3 = run_step(tmp_path, "up", {"v": 3}, {}, writer("different", calls))
    down3 = run_step(tmp_path, "down", {}, {"up": up3}, writer("d", calls))
    assert not down3.cached and down3.step_id != down.step_id


def test_failed_build_leaves_no_finished_step(tmp_path):
    def crash(out):
        (out / "half.txt").write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_step(tmp_path, "a", {}, {}, crash)
    assert not (tmp_path / "a").exists()
    calls: list = []
    out = run_step(tmp_path, "a", {}, {}, writer("whole", calls))
    assert calls == ["whole"] and not out.cached


def test_partial_of_same_step_is_resumed_in_place(tmp_path):
    def crash(out):
        (out / "shard0").write_text("done")
        raise RuntimeError("killed after shard 0")

    with pytest.raises(RuntimeError):
        run_step(tmp_path, "a", {}, {}, crash)

    seen = []

    def resume(out):
        seen.append((out / "shard0").exists())
        (out / "shard1").write_text("done")
        return {}

    run_step(tmp_path, "a", {}, {}, resume)
    assert seen == [True]
    # a partial folder left by a different step id is wiped, never mixed in
    with pytest.raises(RuntimeError):
        run_step(tmp_path, "b", {"v": 1}, {}, crash)
    seen.clear()
    run_step(tmp_path, "b", {"v": 2}, {}, resume)
    assert seen == [False]


def test_folder_without_manifest_is_not_finished(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "data.txt").write_text("stale")
    calls: list = []
    run_step(tmp_path, "a", {}, {}, writer("fresh", calls))
    assert calls == ["fresh"]
    assert (tmp_path / "a" / "data.txt").read_text() == "fresh"


def test_step_id_depends_on_config_and_inputs_only():
    assert step_id("a", {"x": 1, "y": 2}, {"i": "f"}) == step_id("a", {"y": 2, "x": 1}, {"i": "f"})
    assert step_id("a", {"x": 1}, {"i": "f"}) != step_id("a", {"x": 1}, {"i": "g"})


def test_missing_upstream_says_what_to_run(tmp_path):
    with pytest.raises(UpstreamMissing, match="needs the output of step 'mixtures'.*run the stage"):
        load_step(tmp_path, "mixtures", needed_by="pretrain")
