"""Mixture swarms: draws inside the bounds and the repetition cap (refusals counted), fits that find a
planted mixture -> loss law and propose its optimum, Olmix's CSV format, and a swarm run end to end."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from flows.graph import build_graph
from infra.ablation import resolve_ablation
from infra.recipe import RecipeError
from infra.steps import JOB
from infra.swarm import carried, draw_mixtures, grouping, load_swarm, proxy_name
from tasks.curation.mixtures import windows
from tasks.pretrain import mixture_phases, train_configs
from tests.clusters import scores
from tests.helpers import REPO, built, flow_run_logs, micro_recipe, survivors, write_recipe

VALIDATED = ("proposed", "prior", "natural")
PROXIES = [proxy_name(i) for i in range(4)]
TARGETS = {"smol_ppl_code": 1.0, "smol_ppl_math": 1.0, "smol_ppl_prose": 1.0}
FAST = {
    "pretrain.checkpoint.every_steps": 1000,
    "evaluation.checkpoint_tasks": list(TARGETS),
    "evaluation.model_tasks": [],
    "evaluation.limit": 8,
}


def swarm_file(tmp_path: Path, store: Path | None = None, **extra) -> Path:
    """A swarm over the micro recipe, its steps in STORE (a project-wide `storage.store`) if given."""
    base = write_recipe(tmp_path / "micro.yaml", micro_recipe(**FAST, **({"storage.store": str(store)} if store else {})))
    spec = {"name": "mix", "base": base.name, "phase": 0, "proxies": 4, "seed": 3, "targets": TARGETS, **extra}
    path = tmp_path / "swarm.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_draws_stay_in_bounds_pass_the_callers_check_and_count_what_was_redrawn(tmp_path):
    swarm = load_swarm(swarm_file(tmp_path, proxies=40, bounds={"math": [0.05, 0.3]}, concentration=4))
    refused_math = lambda w: "too much code" if w[swarm.sources.index("code")] > 0.5 else None  # noqa: E731
    draws = draw_mixtures(swarm, 40, seed=3, admissible=refused_math)
    w = draws.mixtures
    assert w.shape == (40, 3) and np.allclose(w.sum(axis=1), 1) and (w > 0).all()
    math_, code = w[:, swarm.sources.index("math")], w[:, swarm.sources.index("code")]
    assert (math_ >= 0.05).all() and (math_ <= 0.3).all() and (code <= 0.5).all()
    assert draws.redrawn["outside the bounds"] > 0 and draws.redrawn["too much code"] > 0
    assert np.allclose(w[0], swarm.prior)  # the prior is the first proxy
    assert np.array_equal(draw_mixtures(swarm, 40, seed=3, admissible=refused_math).mixtures, w)  # a rerun draws the same proxies
    assert len({tuple(r) for r in w}) == 40


def test_sparse_draws_leave_sources_out_and_a_proxy_that_does_reads_only_the_tokens_of_the_rest(tmp_path):
    """RegMix's sparse draws: a source whose lower bound is 0 is left out of some proxies (weight 0, not in their
    recipe), and such a proxy's pretraining identity covers the tokens of the sources it draws on alone."""
    swarm = load_swarm(swarm_file(tmp_path, proxies=12, sparsity=0.4, bounds={"math": [0.05, 0.5]}))
    w = draw_mixtures(swarm, 12, seed=3).mixtures
    math_ = swarm.sources.index("math")
    assert np.allclose(w.sum(axis=1), 1) and (w[:, math_] >= 0.05).all(), "a bounded source is never left out"
    assert 3 <= (w == 0).any(axis=1).sum() < 12 and (w > 0).all(axis=1).sum() >= 2
    assert not np.array_equal(w, draw_mixtures(replace(swarm, cfg=swarm.cfg.model_copy(update={"sparsity": 0})), 12, seed=3).mixtures)
    runs = resolve_ablation(swarm.ablation_cfg(w), swarm.path, tmp_path / "sw").runs
    for run, weights in zip(runs, w, strict=True):
        phase = build_graph(run.recipe).phases[0]
        drawn = [s for s, x in zip(swarm.sources, weights, strict=True) if x > 0]
        assert list(run.recipe.pretrain.phases[0].mixture) == drawn
        reads = phase.reads(phase.config)
        assert reads == ({} if len(drawn) == 3 else {"tokens": tuple(f"data/{s}/" for s in drawn), "budget": ()})


def test_a_swarm_file_is_checked_against_its_base_recipe(tmp_path):
    with pytest.raises(RecipeError, match=r"swarm.yaml: bounds.maths: not a source of phase phase1"):
        load_swarm(swarm_file(tmp_path, bounds={"maths": [0, 0.5]}))
    with pytest.raises(RecipeError, match=r"targets.smol_arithmetic_gen: not among the recipe's evaluation.checkpoint_tasks"):
        load_swarm(swarm_file(tmp_path, targets={"smol_arithmetic_gen": 1}))
    with pytest.raises(RecipeError, match=r"bounds: no mixture fits them"):
        load_swarm(swarm_file(tmp_path, bounds={"math": [0.6, 0.9], "code": [0.5, 0.9]}))
    with pytest.raises(RecipeError, match=r"phase: 7 is not a phase index"):
        load_swarm(swarm_file(tmp_path, phase=7))


def test_no_two_proxies_train_on_the_same_data(tmp_path):
    """Weights closer than one seq_len window of each source make the same training data: such a draw is redrawn and
    counted, or its proxy would repeat an earlier run and the fit would count one measurement twice. One free weight
    (frozen prose and code) over the micro recipe's few windows makes such draws likely."""
    from flows.swarm import SAME, open_swarm

    path = swarm_file(tmp_path, proxies=12, frozen=["prose", "code"], seed=1)
    swarm, draws, _ = open_swarm(str(path))
    phase = mixture_phases(swarm.recipe.pretrain)[0]
    data = lambda w: tuple(windows(phase.model_copy(update={"mixture": swarm.mixture(w)})).items())  # noqa: E731
    assert len({data(w) for w in draws.mixtures}) == 12 and draws.redrawn == {SAME: 4}
    assert len({data(w) for w in draw_mixtures(swarm, 12, seed=1).mixtures}) == 10, "unchecked, two pairs would repeat"


def test_every_shipped_swarm_file_opens_and_the_reuse_swarm_goes_on_from_mix_phase1s_proposal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where runs/ is: the reuse swarm's prior is mix_phase1's report there
    report = tmp_path / "runs" / "swarms" / "mix_phase1" / "report" / "swarm.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"proposal": {"mixture": {"prose": 0.35, "code": 0.054, "math": 0.596}}}))
    swarms = {path.stem: load_swarm(path) for path in sorted((REPO / "configs" / "swarms").glob("*.yaml"))}
    assert swarms["mix_phase1_math"].groups.frozen == {
        "prose+code": pytest.approx({"prose": 0.35 / 0.404, "code": 0.054 / 0.404}, abs=1e-6)
    }
    assert swarms["mix_phase1_math"].prior.tolist() == [0.35, 0.054, 0.596]
    assert swarms["mix_phase1_math"].recipe == swarms["mix_phase1"].recipe, "the proxies' scale-down, the same as mix_phase1's"


def test_a_proxy_trains_up_to_the_searched_phase_and_its_learning_rate_decays_there(tmp_path):
    swarm = load_swarm(swarm_file(tmp_path, phase=1))
    runs = resolve_ablation(swarm.ablation_cfg(draw_mixtures(swarm, 4, seed=0).mixtures), swarm.path, tmp_path / "sw").runs
    for run in runs:
        assert [ph.name for ph in run.recipe.pretrain.phases] == ["phase1", "phase2"]
        phase1, phase2 = train_configs(run.recipe)
        end = phase2.schedule.offset + phase2.schedule.steps
        assert end == phase2.schedule.total > phase2.schedule.decay_start >= phase2.schedule.offset, "the decay falls in phase 2"
        assert phase2.yarn_factor is None, "YaRN belongs to the long-context phase the proxy leaves out"
    assert len(load_swarm(swarm_file(tmp_path, phase=1, later_phases=True)).recipe.pretrain.phases) == 4
    with pytest.raises(RecipeError, match=r"pretrain: until_phase: 'phase9' is not a phase \(phase1, phase2, phase3, long_context\)"):
        load_swarm(swarm_file(tmp_path, set=["pretrain.until_phase=phase9"], later_phases=True))


def planted(w: np.ndarray) -> dict[str, np.ndarray]:
    """Per-source losses with a known optimum: each source's loss falls with its own weight (log-linear)."""
    return {
        "prose": np.exp(1.6 - 1.2 * w[:, 0] - 0.1 * w[:, 1]),
        "code": np.exp(1.4 - 1.5 * w[:, 1] + 0.2 * w[:, 0]),
        "math": np.exp(1.2 - 2.5 * w[:, 2]),
    }


def test_the_fits_rank_proxies_of_a_planted_law_and_the_proposal_beats_every_proxy():
    from tasks.evaluation.swarm import choose, fit, propose, rank_agreement

    rng = np.random.default_rng(0)
    prior = np.array([0.45, 0.45, 0.10])
    w = rng.dirichlet(6 * prior, 24)
    noise = {k: v * np.exp(rng.normal(0, 0.005, len(w))) for k, v in planted(w).items()}  # measurement noise
    weights = {"prose": 1.0, "code": 1.0, "math": 1.0}
    alone = grouping(["prose", "code", "math"], prior)
    fits = [fit(family, w, noise, weights, alone) for family in ("log-linear", "lightgbm")]
    by = {f.family: f for f in fits}
    assert by["log-linear"].spearman > 0.95 and all(r > 0.9 for r in by["log-linear"].per_task.values())
    assert by["lightgbm"].spearman > 0.3  # trees on 24 points: a rougher ranking, still with signal
    assert choose(fits).family == "log-linear"
    low, high = np.zeros(3), np.array([1.0, 1.0, 0.4])
    best, predicted, candidates = propose(choose(fits).predict, prior, alone, 6, low, high, lambda x: None, seed=0)
    truth = lambda x: sum(planted(np.atleast_2d(x)).values()) / 3  # noqa: E731
    measured = sum(noise.values()) / 3
    assert best[2] <= 0.4 + 1e-9 and candidates > 1000
    assert truth(best)[0] < measured.min(), "the proposal is better than every proxy under the true law"
    assert predicted == pytest.approx(truth(best)[0], rel=0.02)
    # on 4 proxies the trees cannot split: each held-out proxy gets the mean of the others, which ranks them
    # backwards, and the log-linear fit is chosen
    few = [fit(family, w[:4], {k: v[:4] for k, v in noise.items()}, weights, alone) for family in ("lightgbm", "log-linear")]
    assert few[0].spearman == pytest.approx(-1) and choose(few).family == "log-linear"
    # a constant prediction ranks nothing: n/a, never chosen
    assert np.isnan(rank_agreement(np.ones(4), np.arange(4.0)))
    assert choose([replace(few[1], spearman=math.nan), few[0]]).family == "lightgbm"


def test_frozen_sources_move_as_one_in_the_draws_the_fits_and_the_proposal_from_the_last_reports_proposal(tmp_path):
    """Olmix's mixture reuse: prose and code keep the proportions the last report proposed and move as one weight; the
    swarm searches math against them, and its proposal and report keep them too."""
    from tasks.evaluation.swarm import Evidence, choose, fit, propose, publish, reuse_hint

    last = tmp_path / "last" / "swarm.json"
    last.parent.mkdir()
    last.write_text(json.dumps({"proposal": {"mixture": {"prose": 0.6, "code": 0.2, "math": 0.2}}}))
    swarm = load_swarm(swarm_file(tmp_path, proxies=12, prior=str(last), frozen=["prose", "code"], bounds={"math": [0.05, 0.6]}))
    assert swarm.prior.tolist() == [0.6, 0.2, 0.2] and swarm.groups.names == ["prose+code", "math"]
    w = draw_mixtures(swarm, 12, seed=3).mixtures
    assert np.allclose(w[0], swarm.prior) and np.allclose(w.sum(axis=1), 1)
    assert np.allclose(w[:, 0] / w[:, 1], 3, rtol=2e-3), "prose:code stays 3:1 in every draw (to the weights' 4 decimals)"
    assert np.ptp(w[:, 2]) > 0.2 and (w[:, 2] >= 0.05).all() and (w[:, 2] <= 0.6).all()

    scores = planted(w)  # per-source losses of the whole mixture; the fits see the group's weight and math's alone
    weights = dict.fromkeys(scores, 1.0)
    fits = [fit(f, w, scores, weights, swarm.groups) for f in ("log-linear", "lightgbm")]
    assert choose(fits).family == "log-linear" and choose(fits).spearman > 0.95
    low, high = np.array([0, 0, 0.05]), np.array([1, 1, 0.6])
    best, predicted, _ = propose(choose(fits).predict, swarm.prior, swarm.groups, 8, low, high, lambda x: None, seed=0)
    assert best[0] / best[1] == pytest.approx(3), "the proposal keeps the frozen proportions"
    line = swarm.groups.expand(np.stack([1 - np.linspace(0.05, 0.6, 551), np.linspace(0.05, 0.6, 551)], axis=1))
    truth = lambda x: sum(planted(np.atleast_2d(x)).values())  # noqa: E731
    assert truth(best)[0] <= truth(line).min() * 1.002, "the best math weight on the frozen line, under the true law"

    ev = Evidence(
        [proxy_name(i) for i in range(12)],
        swarm.sources,
        w,
        scores,
        dict.fromkeys(scores, "bits_per_byte"),
        [],
        dict.fromkeys(swarm.sources, "a" * 24),
    )
    proposal = {"mixture": swarm.as_dict(best), "predicted": predicted, "candidates": 1, "family": "log-linear"}
    path = publish(tmp_path / "mix", "mix", ["# Swarm mix"], ev, weights, fits, proposal, swarm.prior, swarm.groups, (low, high))
    assert "Frozen (Olmix's mixture reuse): prose+code move as one weight, in the prior's proportions 0.750 prose : 0.250 code" in (
        path.read_text()
    )
    assert json.loads((path.parent / "swarm.json").read_text())["frozen"] == {"prose+code": {"prose": 0.75, "code": 0.25}}

    for frozen, error in (
        (["prose"], r"frozen: \['prose'\]: name two sources or more"),
        (["prose", "maths"], r"frozen: maths: not a source of phase phase1"),
        (["prose", "code", "math"], r"frozen: every source of phase phase1: leave one or more free"),
    ):
        with pytest.raises(RecipeError, match=error):
            load_swarm(swarm_file(tmp_path, frozen=frozen))
    # Olmix's other updates: a source the last swarm searched is gone (wiki: left out, the rest renormalized) and one it
    # did not know is added (math: the recipe's 0.1, the proposal the other 0.9); math is searched against the rest
    last.write_text(json.dumps({"proposal": {"mixture": {"prose": 0.45, "code": 0.15, "wiki": 0.4}}}))
    added = load_swarm(swarm_file(tmp_path, prior=str(last), frozen=["prose", "code"]))
    assert added.prior.tolist() == [0.675, 0.225, 0.1] and added.groups.names == ["prose+code", "math"]
    # ... the keys a rerun suggests when math joins the phase (or its tokens change)
    hint = reuse_hint(
        ["math"], added.sources, carried({"prose": 0.45, "code": 0.15, "wiki": 0.4}, {"prose": 0.8, "math": 0.1, "code": 0.1})
    )
    assert "a swarm file with `prior: {prose: 0.675, code: 0.225, math: 0.1}` and `frozen: [prose, code]`" in hint
    last.write_text(json.dumps({"proposal": {"mixture": {"wiki": 1.0}}}))
    with pytest.raises(RecipeError, match=r"prior: .*swarm.json: its proposal shares no source with the phase \(prose, code, math\)"):
        load_swarm(swarm_file(tmp_path, prior=str(last)))
    with pytest.raises(
        RecipeError, match=r"swarm.yaml: prior: .*nowhere.json: not a swarm report with a proposal \(run that swarm first\)"
    ):
        load_swarm(swarm_file(tmp_path, prior=str(tmp_path / "nowhere.json")))


def test_the_report_writes_olmix_ratios_and_metrics(tmp_path):
    from tasks.evaluation.swarm import Evidence, fit, publish, response

    rng = np.random.default_rng(1)
    w = rng.dirichlet([4, 4, 2], 8)
    scores = {f"smol_ppl_{k}": v for k, v in planted(w).items()}
    domains = {"prose": "a" * 24, "code": "b" * 24, "math": "c" * 24}
    names, metric = [proxy_name(i) for i in range(8)], dict.fromkeys(scores, "bits_per_byte")
    ev = Evidence(names, ["prose", "code", "math"], w, scores, metric, [], domains)
    weights = dict.fromkeys(scores, 1.0)
    prior, bounds = np.array([0.45, 0.45, 0.1]), (np.zeros(3), np.ones(3))
    alone = grouping(["prose", "code", "math"], prior)
    fits = [fit(f, w, scores, weights, alone) for f in ("log-linear", "lightgbm")]
    proposal = {"mixture": {"prose": 0.3, "code": 0.3, "math": 0.4}, "predicted": 1.0, "candidates": 10, "family": "log-linear"}
    path = publish(tmp_path / "mix", "mix", ["# Swarm mix"], ev, weights, fits, proposal, prior, alone, bounds)
    out = path.parent
    with open(out / "ratios.csv") as f:
        ratios = list(csv.DictReader(f))
    with open(out / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    assert list(ratios[0]) == ["run_id", "name", "prose", "code", "math"]
    assert [r["run_id"] for r in ratios] == [r["run_id"] for r in metrics] == [proxy_name(i) for i in range(8)]
    assert all(abs(sum(float(r[s]) for s in ("prose", "code", "math")) - 1) < 1e-4 for r in ratios)
    assert "smol_ppl_math/bits_per_byte" in metrics[0] and "target" in metrics[0]
    target = sum(scores.values()) / 3
    assert [float(r["target"]) for r in metrics] == pytest.approx(target, abs=1e-5)
    data = json.loads((out / "swarm.json").read_text())
    assert data["chosen"] == "log-linear" and len(data["proxies"]) == 8 and data["trusted"] is True
    text = path.read_text()
    assert "## Proposed mixture" in text and "(chosen)" in text and (out / "fit.png").is_file()
    assert "![response curves](response.png)" in text and (out / "response.png").is_file()
    # a source's response: the planted math loss falls along math's weight, the others in the prior's proportions
    math_fit = fit("log-linear", w, {"smol_ppl_math": scores["smol_ppl_math"]}, {"smol_ppl_math": 1.0}, alone)
    x, predicted = response(math_fit.predict, prior, alone, 2, (0.05, 0.6))
    assert x[0] == 0.05 and x[-1] == 0.6 and (np.diff(predicted) < 0).all()
    assert data["domains"] == domains and "Changed since" not in text
    # the code tokens change: the next report says its evidence was measured on other data
    ev = replace(ev, domains=domains | {"code": "d" * 24})
    text = publish(tmp_path / "mix", "mix", ["# Swarm mix"], ev, weights, fits, proposal, prior, alone, bounds).read_text()
    assert "**Changed since the last report:** the tokens of code" in text
    # ... and how to search code alone against prose and math as the last report proposed them (Olmix's mixture reuse)
    assert "a swarm file with `prior: {prose: 0.3, code: 0.3, math: 0.4}` and `frozen: [prose, math]`" in text


def test_a_failed_proxy_is_returned_with_its_error_while_the_others_train(tmp_path, prefect_server, monkeypatch):
    """run_all(keep_going=True), as a swarm calls it: one proxy's failure ends neither the swarm nor its other proxies."""
    from prefect import flow

    import flows.ablation
    from flows.swarm import open_swarm

    @flow
    def pipeline(base: str, run_dir: str, overrides: list[str], until: str | None) -> None:  # each proxy's pipeline, in short
        if run_dir.endswith("p001"):
            raise RuntimeError("p001 broke on purpose\nmore lines of its traceback")
        (Path(run_dir) / "trained").touch()

    monkeypatch.setattr(flows.ablation, "full_pipeline", pipeline)
    _, _, abl = open_swarm(str(swarm_file(tmp_path, concurrency=2)), str(tmp_path / "sw"))
    failed = flow(lambda: flows.ablation.run_all(abl, keep_going=True), name="swarm")()
    assert failed == {"p001": "RuntimeError: p001 broke on purpose"}
    assert sorted(p.parent.name for p in (tmp_path / "sw").glob("p*/trained")) == ["p000", "p002", "p003"]
    with pytest.raises(RuntimeError, match="p001 broke on purpose"):  # an ablation's comparison needs every run
        flow(lambda: flows.ablation.run_all(abl), name="ablation")()


SIGNALLED = """
import os, sys
from pathlib import Path

from prefect import flow

import flows.ablation
from flows.swarm import open_swarm
from infra.launch import run_streaming

out = Path(sys.argv[2])
SLEEPER = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"


@flow
def pipeline(base: str, run_dir: str, overrides: list, until: str | None) -> None:  # a proxy whose trainer runs on
    name = Path(run_dir).name
    (out / f"started.{name}").touch()
    run_streaming([sys.executable, "-c", SLEEPER], dict(os.environ), (out / f"pid.{name}").write_text)


flows.ablation.full_pipeline = pipeline
_, _, abl = open_swarm(sys.argv[1], str(out / "sw"))
flow(lambda: flows.ablation.run_all(abl, keep_going=True), name="swarm")()
"""


def test_a_signalled_swarm_stops_its_proxies_in_flight_and_starts_no_more(tmp_path, prefect_server):
    """SIGTERM reaches only the main thread (Prefect raises there); the proxies run in threads beside it. They stop
    too (their trainers are stopped, not waited for), the queued ones never start, and the process ends."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    from tests.helpers import REPO

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    path = swarm_file(tmp_path, concurrency=2)
    driver = subprocess.Popen([sys.executable, "-c", SIGNALLED, str(path), str(tmp_path)], env=env, cwd=REPO)
    deadline = time.time() + 300
    while len(pids := [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text().strip()]) < 2:
        assert time.time() < deadline and driver.poll() is None, "two proxies never ran at once"
        time.sleep(0.2)
    driver.send_signal(signal.SIGTERM)
    try:
        driver.wait(timeout=90)
    finally:
        driver.kill()
    assert not survivors(pids, 10), "a proxy's trainer outlived the signalled swarm"
    assert sorted(p.name for p in tmp_path.glob("started.*")) == ["started.p000", "started.p001"], "a queued proxy started"


@pytest.mark.slow
def test_a_swarm_curates_once_trains_each_proxy_fits_proposes_and_a_rerun_builds_nothing(
    tmp_path, prefect_server, local_swarm, swarm_store
):
    from flows.swarm import swarm_flow

    # the micro recipe holds out no math documents: its bits per byte cannot be a target
    targets = {"smol_ppl_code": 1.0, "smol_ppl_prose": 2.0}
    # the validation at 2x the proxies' tokens (4x by default): it trains 6 runs. The 4 proxies are the same draws as
    # local_swarm's, whose steps are in the project-wide store this swarm shares: its curation and proxies are cached
    path = swarm_file(tmp_path, swarm_store, concurrency=2, bounds={"math": [0.05, 0.5]}, targets=targets, validation={"scale": 2})
    root = tmp_path / "sw"
    before = len(built(swarm_store))
    report = Path(swarm_flow(str(path), str(root)))

    builds = built(swarm_store)
    assert builds.count("tokenize") == 1 and builds.count("filter") == 1, "curation is built once for every proxy"
    assert scores(root) == local_swarm.scores, "the proxies' scores, from the steps the other swarm built"
    # the prior's proxy shares the curation run's mixtures step; every other proxy draws its own
    # 4 proxies, then the 3 mixtures x 2 seeds at 2x (a mixtures step per mixture, which its seeds share)
    mixed = {v: json.loads((root / "validate" / f"{v}-seed0" / "mixtures" / "mixtures.json").read_text()) for v in VALIDATED}
    distinct = len({json.dumps(m, sort_keys=True) for m in mixed.values()})
    assert builds.count("mixtures") == 4 + distinct and builds.count("pretrain_phase1") == 4 + 2 * distinct
    built_here = sorted(builds[before:])  # the validation's runs only
    assert built_here == ["mixtures"] * distinct + ["pretrain_phase1"] * (2 * distinct), "a proxy was built again"
    with open(root / "report" / "ratios.csv") as f:
        ratios = list(csv.DictReader(f))
    assert [r["run_id"] for r in ratios] == [proxy_name(i) for i in range(4)]
    for r in ratios:  # each proxy trained the mixture it was drawn with
        manifest = json.loads((root / r["run_id"] / "mixtures" / "mixtures.json").read_text())
        weights = {s: row["weight"] for s, row in manifest["phases"][0]["sources"].items()}
        assert weights == pytest.approx({s: float(r[s]) for s in ("prose", "code", "math")}, abs=1e-6)
        assert 0.05 <= weights["math"] <= 0.5
    with open(root / "report" / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    targets = [float(m["target"]) for m in metrics]
    assert len(set(targets)) == 4 and all(0 < t < 20 for t in targets), "each proxy's bits per byte, measured on its own model"
    data = json.loads((root / "report" / "swarm.json").read_text())
    proposal = data["proposal"]["mixture"]
    assert sum(proposal.values()) == pytest.approx(1, abs=1e-9) and 0.05 <= proposal["math"] <= 0.5
    assert all(round(w, 4) == w for w in proposal.values()), "rounded: a recipe takes weights that sum to 1 within 1e-6"
    text = report.read_text()
    assert "## Proposed mixture" in text and (root / "report" / "fit.png").is_file()
    # cost: each proxy's own mixtures and pretraining steps, the 7 curation steps all share
    assert "the proxies' own steps" in text and "(8 steps, " in text and "7 steps shared by the proxies" in text

    # the validation: the proposal, the prior and the natural mixture at 2x the proxies' tokens, 2 seeds each
    validation = {d.name for d in (root / "validate").iterdir() if (d / "recipe.json").is_file()}
    assert validation == {f"{v}-seed{k}" for v in VALIDATED for k in (0, 1)}
    phase1 = lambda run: mixed[run.removesuffix("-seed0").removesuffix("-seed1")]["phases"][0]  # noqa: E731
    assert phase1("prior-seed0")["tokens"] == 2 * 8000
    assert {s: r["weight"] for s, r in phase1("proposed-seed1")["sources"].items()} == pytest.approx(proposal, abs=1e-6)
    tokens = {s: r["available"] for s, r in phase1("natural-seed0")["sources"].items()}
    natural = {s: r["weight"] for s, r in phase1("natural-seed0")["sources"].items()}
    assert natural == pytest.approx({s: n / sum(tokens.values()) for s, n in tokens.items()}, abs=1e-3)
    assert builds.count("tokenize") == 1, "the validation reads the proxies' curation from their store"
    assert "## Validation at 2x the proxies' tokens, 2 seeds" in text and "pairs of these mixtures as the larger runs do" in text
    # one MFU probe for every run of the store, taken before the first trainer: each run took its own before, the later
    # ones beside the earlier ones' training
    [probes] = json.loads((swarm_store / "peak_flops.json").read_text()).values()  # this host's
    peaks = {json.loads((root / "validate" / run / "pretrain_phase1" / JOB).read_text())["config"]["peak_flops"] for run in validation}
    assert peaks == {probes["1"]["flops_per_rank"]}
    compared = json.loads((root / "validate" / "report" / "ablation.json").read_text())["rows"]
    assert {e["task"] for e in compared if e["variant"] == "proposed" and "verdict" in e} == {"smol_ppl_code", "smol_ppl_prose"}

    swarm_flow(str(path), str(root))  # the same draws, the same step identities: nothing is built again
    assert len(built(swarm_store)) == len(builds)


@pytest.mark.slow
def test_a_rerun_after_one_source_changed_trains_only_the_proxies_that_draw_on_it(tmp_path, prefect_server):
    """Evidence tied to content: with a named tokenizer, changing math's documents changes math's tokens alone; the
    rerun trains again the proxies that draw on math and reuses, model and scores, the one that left it out."""
    from flows.swarm import swarm_flow
    from tasks.curation.tokenizer import save_hf, train_bpe

    texts = [Path(csv.__file__).read_text(), Path(json.__file__).read_text(), *(f"What is {i} + {i}? {2 * i}." for i in range(200))]
    tokenizer = tmp_path / "tokenizer"
    save_hf(train_bpe(iter(texts * 2), vocab_size=512, min_frequency=2), tokenizer)
    # seed 35 draws p000 (the prior) and p001 with math, p002 and p003 without it (a rerun trains two proxies, one round
    # at `concurrency: 2`); micro holds out no math documents
    path = swarm_file(
        tmp_path,
        seed=35,
        sparsity=0.5,
        concurrency=2,
        validation=None,
        targets={"smol_ppl_code": 1.0, "smol_ppl_prose": 1.0},
        set=[f"curate.tokenizer={{path: {tokenizer / 'tokenizer.json'}}}"],
    )
    root = tmp_path / "sw"
    swarm_flow(str(path), str(root))
    before = scores(root)
    model_ids = lambda: {p: json.loads((root / p / "pretrain_phase1" / "manifest.json").read_text())["step_id"] for p in PROXIES}  # noqa: E731
    trained = model_ids()
    done = len(built(root / "steps"))

    state = swarm_flow(str(path), str(root), ["embedded.math_problems=500"], return_state=True)
    report = Path(state.result())
    builds = built(root / "steps")[done:]
    # said before it trained them, with the keys of the cheaper search (math alone against the rest as proposed)
    [said] = [line for line in flow_run_logs(state.state_details.flow_run_id) if "changed since the last report" in line]
    assert "the tokens of math changed since the last report: the 2 of 4 proxies that draw on them train again" in said
    assert "`frozen: [prose, code]`" in said and "`prior: {prose: " in said
    assert builds.count("tokenize") == 1 and builds.count("pretrain_phase1") == 2, builds
    again = model_ids()
    assert [p for p in trained if again[p] == trained[p]] == ["p002", "p003"], "only the proxies without math keep their models"
    after = {r["run_id"]: r for r in scores(root)}
    for kept in ("p002", "p003"):
        assert after[kept] == next(r for r in before if r["run_id"] == kept), "its scores are reused as measured"
    proxies = {p["name"]: p for p in json.loads((root / "report" / "swarm.json").read_text())["proxies"]}
    assert set(proxies["p002"]["domains"]) == {"prose", "code"} and set(proxies["p001"]["domains"]) == {"prose", "code", "math"}
    text = report.read_text()
    assert "**Changed since the last report:** the tokens of math" in text and "2 proxies that draw on them were trained" in text
    assert "2 that leave them out were reused as they were (p002, p003:" in text

    # the search the log named: math alone against prose and code as the first report proposed them (Olmix's mixture
    # reuse), 4 proxies on one free weight, in the same store (its curation is cached)
    keys = re.search(r"`prior: (\{.*?\})` and `frozen: (\[.*?\])`", said)
    prior, frozen = yaml.safe_load(keys.group(1)), yaml.safe_load(keys.group(2))
    (tmp_path / "reuse").mkdir()
    path = swarm_file(
        tmp_path / "reuse",
        root / "steps",
        prior=prior,
        frozen=frozen,
        concurrency=2,
        validation=None,
        targets={"smol_ppl_code": 1.0, "smol_ppl_prose": 1.0},
        set=[f"curate.tokenizer={{path: {tokenizer / 'tokenizer.json'}}}"],
    )
    done = len(built(root / "steps"))
    report = Path(swarm_flow(str(path), str(tmp_path / "reuse" / "sw"), ["embedded.math_problems=500"]))
    new = built(root / "steps")[done:]
    assert new.count("pretrain_phase1") == 4 and "tokenize" not in new and "filter" not in new, "its curation cached"
    for p in PROXIES:  # each proxy trained prose and code in the proportions proposed before
        phase = json.loads((report.parents[1] / p / "mixtures" / "mixtures.json").read_text())["phases"][0]["sources"]
        assert phase["prose"]["weight"] / phase["code"]["weight"] == pytest.approx(prior["prose"] / prior["code"], rel=5e-3)
    data = json.loads(report.with_suffix(".json").read_text())
    assert data["frozen"] == {"prose+code": pytest.approx({s: prior[s] / (prior["prose"] + prior["code"]) for s in frozen}, abs=1e-6)}
    proposal = data["proposal"]["mixture"]
    assert proposal["prose"] / proposal["code"] == pytest.approx(prior["prose"] / prior["code"], rel=5e-3)
    assert "Frozen (Olmix's mixture reuse): prose+code move as one weight" in report.read_text()
