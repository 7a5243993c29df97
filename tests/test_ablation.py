"""Ablations: variants validated before anything runs, shared steps built once (also when variants
run at once), a rerun builds nothing, and a report with intervals for every variant."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.errors import SmolflowError
from infra.recipe import RecipeError
from tests.helpers import REPO, built, built_folders, flow_run_logs, micro_recipe, stand_in, write_recipe

# post-training small enough for a test; checkpoints evaluated on one cloze task, models on one generative one
FAST = {
    "pretrain.checkpoint.every_steps": 1000,
    "postrain.data.generated": 300,
    "postrain.data.heldout": 20,
    "postrain.sft.max_steps": 20,
    "postrain.sft.weak_checkpoint_step": 5,
    "postrain.sft.logging_steps": 5,
    "evaluation.checkpoint_tasks": ["smol_arithmetic_cf"],
    "evaluation.limit": 8,
}


def ablation_file(tmp_path: Path, variants: list[dict], file: str = "ablation.yaml", **extra) -> Path:
    base = write_recipe(tmp_path / "micro.yaml", micro_recipe(**FAST))
    spec = {"name": "apo_vs_dpo", "base": base.name, "until": "apo", "variants": variants, **extra}
    path = tmp_path / file
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


APO_VS_DPO = [
    {"name": "apo", "set": ["postrain.apo.loss_type=[apo_zero, sft]"]},
    {"name": "dpo", "set": ["postrain.apo.loss_type=[sigmoid, sft]"]},
]


def test_a_bad_override_names_the_variant_and_the_key(tmp_path):
    from flows.ablation import open_ablation

    bad = ablation_file(tmp_path, [APO_VS_DPO[0], {"name": "dpo", "set": ["postrain.apo.loss_typo=[sigmoid]"]}])
    with pytest.raises(RecipeError, match=r"(?s)variant dpo: .*postrain\.apo\.loss_typo: unknown key"):
        open_ablation(str(bad))
    wrong_type = ablation_file(tmp_path, [APO_VS_DPO[0], {"name": "slow", "set": ["postrain.apo.max_steps=-3"]}], "b.yaml")
    with pytest.raises(RecipeError, match=r"(?s)variant slow: .*postrain\.apo\.max_steps"):
        open_ablation(str(wrong_type))
    evals = ablation_file(tmp_path, [APO_VS_DPO[0], {"name": "lenient", "set": ["evaluation.limit=100"]}], "c.yaml")
    with pytest.raises(RecipeError, match="variant lenient: evaluation.limit: variants share one evaluation"):
        open_ablation(str(evals))
    seeds = ablation_file(tmp_path, APO_VS_DPO, "d.yaml", seeds=2, seed_key="postrain.apo.beta")
    with pytest.raises(RecipeError, match=r"seed_key postrain\.apo\.beta: not an integer key"):
        open_ablation(str(seeds))
    # the CLI says it in one line, before any Prefect server starts, and runs nothing
    out = subprocess.run([str(Path(sys.executable).parent / "smolflow"), "ablate", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "variant dpo" in out.stderr and "Traceback" not in out.stderr
    assert not (REPO / "runs" / "ablations" / "apo_vs_dpo" / "dpo").exists()


def test_dry_run_shows_what_is_shared_and_what_each_seed_builds(tmp_path):
    from flows.ablation import explain, open_ablation, report

    abl = open_ablation(str(ablation_file(tmp_path, APO_VS_DPO, seeds=2)), str(tmp_path / "abl"))  # seed_key auto
    assert [r.name for r in abl.runs] == ["apo-seed0", "apo-seed1", "dpo-seed0", "dpo-seed1"]
    assert abl.runs[1].overrides[-1] == "postrain.apo.seed=1235"
    assert [r.seed for r in abl.runs] == [1234, 1235, 1234, 1235]  # unset per-step seed: the recipe's, then +1
    lines = explain(abl)
    assert "apo-seed1..dpo-seed1 (3)" in next(line for line in lines if line.startswith("step ")), "like runs share a column"
    table = plan_cells(lines)
    assert table["sft"] == ["build*", "shared*", "shared*", "shared*"]  # SFT is the same in every run
    assert table["apo"] == ["build", "build", "build", "build"]  # APO differs by variant and by seed
    assert any("64 steps in all runs, 19 distinct: sharing saves 45 builds" in line for line in explain(abl))
    distinct, now, total = pretraining_tokens(explain(abl))
    assert total == 4 * distinct and now == distinct > 0, "pretraining is shared by the 4 runs, and nothing is cached yet"
    floor = "Noise floor: measured from apo's 2 seeds (varying postrain.apo.seed); their own steps, built per seed: apo."
    assert explain(abl)[-1] == floor
    with pytest.raises(SmolflowError, match=r"this ablation has not run yet: run `smolflow ablate .*ablation.yaml` first"):
        report(abl)  # `smolflow ablate --report` before any run


def test_a_seed_study_varies_every_trainer_seed_together_and_shares_curation(tmp_path):
    """The ladder study (configs/ablations/ladder_seeds.yaml): one variant, seeds on a list of keys, each its own
    value + k; curation is shared because `seed`, which builds the corpus, is not among them."""
    from flows.ablation import explain, open_ablation

    keys = ["pretrain.seed", "postrain.sft.seed", "postrain.apo.seed"]
    abl = open_ablation(str(ablation_file(tmp_path, [{"name": "tiny"}], seeds=2, seed_key=keys, until="apo")), str(tmp_path / "a"))
    assert [r.name for r in abl.runs] == ["tiny-seed0", "tiny-seed1"]
    assert abl.runs[1].overrides == ("pretrain.seed=1235", "postrain.sft.seed=1235", "postrain.apo.seed=1235")
    assert [abl.runs[1].recipe.postrain.sft.seed, abl.runs[1].recipe.pretrain.seed] == [1235, 1235]
    table = plan_cells(explain(abl))
    assert table["tokenize"] == ["build*", "shared*"] and table["chat_data"] == ["build*", "shared*"]
    assert table["pretrain_phase1"] == ["build", "build"] and table["sft"] == ["build", "build"]
    one = ablation_file(tmp_path, [{"name": "tiny"}], "one.yaml")
    with pytest.raises(RecipeError, match=r"one variant compares nothing: add a variant, or `seeds: 2`"):
        open_ablation(str(one))
    typo = ablation_file(tmp_path, [{"name": "tiny"}], "typo.yaml", seeds=2, seed_key=["pretrain.seed", "postrain.sft.sead"])
    with pytest.raises(RecipeError, match=r"seed_key postrain\.sft\.sead: the recipe has no such key"):
        open_ablation(str(typo))


def test_seed_key_auto_repeats_the_trained_steps_the_variants_build_apart_and_nothing_upstream(tmp_path):
    """The default seed_key: the seeds (Step.seed) of the trained steps whose plan differs between the variants, so
    an SFT change repeats SFT and the APO after it, a pretraining change pretraining and what follows; never the
    recipe's `seed`, which would rebuild the corpus. A seed study repeats every step it trains."""
    from flows.ablation import explain, open_ablation

    def keys(variants, file, **extra):
        abl = open_ablation(str(ablation_file(tmp_path, variants, file, seeds=2, **extra)), str(tmp_path / file))
        table = plan_cells(explain(abl))
        assert set(table["tokenize"]) == {"build*", "shared*"}, file  # curation is built once for every run
        return abl.cfg.seed_keys

    assert keys(APO_VS_DPO, "apo.yaml") == ["postrain.apo.seed"]
    assert keys(SFT_LR, "sft.yaml") == ["postrain.sft.seed", "postrain.apo.seed"]
    lr = [{"name": "lr3", "set": ["pretrain.optimizer.lr=3e-3"]}, {"name": "lr1", "set": ["pretrain.optimizer.lr=1e-3"]}]
    assert keys(lr, "pretrain.yaml", until="sft") == ["pretrain.seed", "postrain.sft.seed"]
    assert keys([{"name": "tiny"}], "study.yaml") == ["pretrain.seed", "postrain.sft.seed", "postrain.apo.seed"]
    dedup = [{"name": "exact"}, {"name": "fuzzy", "set": ["curate.dedup.exact=false"]}]
    with pytest.raises(SmolflowError, match=r"seed_key auto: the variants train no step apart within `until`; name the seed_key"):
        open_ablation(str(ablation_file(tmp_path, dedup, "curate.yaml", seeds=2, until="curate")))
    one = open_ablation(str(ablation_file(tmp_path, dedup, "curate1.yaml", until="curate")), str(tmp_path / "c1"))  # one seed
    assert [r.seed for r in one.runs] == [None, None] and not one.runs[0].overrides
    assert any("seeds would not measure it: the variants train no step apart" in line for line in explain(one))


def test_every_shipped_ablation_file_opens_and_names_its_runs(tmp_path):
    from flows.ablation import open_ablation

    for path in sorted((REPO / "configs" / "ablations").glob("*.yaml")):
        abl = open_ablation(str(path), str(tmp_path / path.stem))
        assert len(abl.runs) >= 2 and len({r.name for r in abl.runs}) == len(abl.runs), path


def test_the_ladder_holds_only_where_a_rung_climbs_beyond_noise_in_every_run_and_was_trained_from_the_rung_below(tmp_path):
    from infra.summaries import HeldoutEval, outcomes
    from tasks.evaluation.compare import ladder_by_run

    def rung(right: int, tokens: float) -> HeldoutEval:  # the first RIGHT of 200 prompts answered right
        kept = outcomes([f"p{i}" for i in range(200)], [float(i < right) for i in range(200)])
        return HeldoutEval(
            items=200, accuracy=right / 200, mean_answer_tokens=tokens, answered=1.0, by_family={}, examples=[], outcomes=kept
        )

    ladders = {
        "seed0": [("base", rung(0, 40)), ("sft", rung(120, 20)), ("apo", rung(150, 18))],
        "seed1": [("base", rung(0, 40)), ("sft", rung(110, 21)), ("apo", rung(112, 25))],  # APO: +2 of 200, longer
    }
    lines, rows = ladder_by_run(ladders)
    assert [(r["rung"], r["up_in_every_run"], r["not_longer_in_every_run"]) for r in rows] == [
        ("sft over base", True, True),
        ("apo over sft", False, False),
    ]
    assert "+1.0%: within noise" in rows[1]["runs"]["seed1"] and "+15.0%: up" in rows[1]["runs"]["seed0"]
    assert "| no (1 of 2) | no |" in lines[3]
    assert lines[-1] == "**Holds in every run:** sft over base. **Does not:** apo over sft."
    partial = ladder_by_run({**ladders, "seed2": ladders["seed0"][:2]})[1]  # seed2's APO not trained yet: nothing holds yet
    assert partial[1]["runs"]["seed2"] == "not trained yet" and not partial[1]["up_in_every_run"]
    rebuilt = ladder_by_run({**ladders, "seed1": ladders["seed0"]}, {"seed1": {"apo"}})[1]  # seed1's SFT rebuilt alone
    assert rebuilt[1]["runs"]["seed1"] == "not compared: trained from another sft (out of date)"
    assert not rebuilt[1]["up_in_every_run"] and not rebuilt[1]["not_longer_in_every_run"] and rebuilt[0]["up_in_every_run"]


def pretraining_tokens(lines: list[str]) -> tuple[int, ...]:
    """The dry run's pretraining tokens: in the distinct steps, of them to train now, for independent runs."""
    line = next(line for line in lines if line.startswith("Pretraining tokens: "))
    shared = r"([\d,]+) (?:in the distinct steps instead of ([\d,]+) for independent runs|\(the runs share no pretraining step\))"
    todo = r"(all cached|all to train now|([\d,]+) of them to train now, the rest cached)"
    distinct, total, said, now = re.fullmatch(f"Pretraining tokens: {shared}; {todo}.", line).groups()
    number = lambda n: int(n.replace(",", ""))  # noqa: E731
    now = number(now) if now else 0 if said == "all cached" else number(distinct)
    return number(distinct), now, number(total or distinct)


def plan_cells(lines: list[str]) -> dict[str, list[str]]:
    """The dry run's table as step -> one cell per run; a column headed `first..last (n)` stands for n runs."""
    start = next(i for i, line in enumerate(lines) if line.startswith("step "))
    end = next(i for i, line in enumerate(lines) if line.startswith("(* "))
    counts = [int(m.group(1)) if (m := re.search(r"\.\.\S+ \((\d+)\)$", h)) else 1 for h in re.split(r"\s{2,}", lines[start].strip())[1:]]
    return {r[0]: [c for c, n in zip(r[1:], counts) for _ in range(n)] for r in map(str.split, lines[start + 1 : end])}


def test_an_ablation_of_a_recipe_with_a_project_store_finds_what_a_plain_run_built(tmp_path):
    """`storage.store`: the demo and the ablations of its recipe share one store, so the dry run says `cached`
    for the steps the demo built (built here with stand-in functions, identities as in a real run)."""

    from flows.ablation import explain, open_ablation
    from flows.graph import build_graph
    from infra.steps import Run

    base = write_recipe(tmp_path / "micro.yaml", micro_recipe(**FAST, **{"storage.store": str(tmp_path / "steps")}))
    run, outputs = Run.open(str(base), str(tmp_path / "micro")), {}
    for step in [s for s in build_graph(run.recipe).steps if s.stage in ("curate", "pretrain")]:
        outputs[step.name] = run.build(stand_in(step), {role: outputs[d.name] for role, d in step.deps.items()})
    spec = {"name": "lr", "base": base.name, "until": "sft", "variants": SFT_LR}
    (tmp_path / "lr.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    lines = explain(open_ablation(str(tmp_path / "lr.yaml"), str(tmp_path / "abl")))
    table = plan_cells(lines)
    assert table["tokenize"] == ["cached*", "cached*"] and table["pretrain_long_context"] == ["cached*", "cached*"]
    assert table["sft"] == ["build", "build"] and any(f"cached in {tmp_path / 'steps'}" in line for line in lines)
    distinct, now, total = pretraining_tokens(lines)
    assert total == 2 * distinct > 0 and now == 0, "the plain run's pretraining is cached: nothing to train now"
    assert lines[-1].startswith("Noise floor: one seed of slow: for the pretrained model's tasks, the jitter of its last 4 checkpoints")


# two SFT learning rates: curation, pretraining and the chat data are shared, SFT is built per variant
SFT_LR = [{"name": "slow", "set": ["postrain.sft.learning_rate=0.002"]}, {"name": "fast", "set": ["postrain.sft.learning_rate=0.005"]}]
# pretraining as one phase (each phase is a launch: a rank's imports), with the context the generative task needs
# (long_context's) and the checkpoints the early-signal checks need (3)
ONE_PHASE = ["pretrain.until_phase=phase1", "pretrain.seq_len=128", "pretrain.checkpoint.every_steps=5"]


@pytest.mark.slow
def test_two_variants_at_once_build_each_shared_step_once_and_compare_with_intervals(tmp_path, prefect_server):
    from flows.ablation import ablation_flow
    from flows.graph import build_graph
    from flows.pipeline import source_recipe
    from tasks.evaluation.report import build_report
    from tasks.evaluation.results import run_results

    path = ablation_file(tmp_path, SFT_LR, until="sft", concurrency=2, set=ONE_PHASE)  # both variants run at the same time
    root = tmp_path / "abl"
    state = ablation_flow(str(path), str(root), return_state=True)
    report = Path(state.result())
    said = [line for line in flow_run_logs(state.state_details.flow_run_id) if " runs ended in " in line]
    assert [line.split(": ")[1].split(" in ")[0] for line in said] == ["1 of 2 runs ended", "2 of 2 runs ended"], said
    assert "min left at this pace" in said[0] and "left" not in said[1]  # progress after each run, the time left until the last

    folders = built_folders(root / "steps")
    assert len(folders) == len(set(folders))  # no store folder was built twice
    builds = built(root / "steps")
    shared = ["chat_data", "corpus", "decontaminate", "dedup", "filter", "ingest", "mixtures"]
    shared += ["pretrain_phase1", "tokenize", "tokenizer"]
    assert sorted(builds) == sorted(shared + ["sft", "sft"])  # each shared step once, SFT once per variant
    for name in shared:  # both run dirs link the same store folder
        assert (root / "slow" / name).resolve() == (root / "fast" / name).resolve()
    assert (root / "slow" / "sft").resolve() != (root / "fast" / "sft").resolve()
    lrs = {v: json.loads((root / v / "sft" / "manifest.json").read_text())["config"]["sft"]["learning_rate"] for v in ("slow", "fast")}
    assert lrs == {"slow": 0.002, "fast": 0.005}
    assert not (root / "steps" / ".previous").exists()

    # shared models are scored once: one object per task and distinct model in the shared result store
    objects = [json.loads(p.read_text()) for p in (root / "evals" / "results").glob("*.json")]
    assert len({(r["fingerprint"], *r["tasks"]) for r in objects}) == len(objects)
    labels = [r["model"]["label"] for r in run_results(root).all()]
    assert labels.count("base") == 1 and labels.count("sft") == 2
    # each run's report card lists its own SFT model's results (2 tasks), not the other variant's
    for variant in ("slow", "fast"):
        card = build_report(root / variant, variant, build_graph(source_recipe(str(root / variant), None)).steps)
        assert sorted(r["task"] for r in card.eval_rows if r["model"] == "sft") == ["smol_arithmetic_cf", "smol_arithmetic_gen"]

    data = json.loads((root / "report" / "ablation.json").read_text())
    rows = [r for r in data["rows"] if r["model"] == "sft"]
    assert {r["variant"] for r in rows} == {"slow", "fast"}
    compared = {r["task"]: r for r in rows if r["variant"] == "fast"}
    assert {"held-out", "smol_arithmetic_gen"} <= set(compared)
    base = next(r for r in rows if r["variant"] == "slow" and r["task"] == "held-out")
    held_out = compared["held-out"]  # the same prompts: compared prompt by prompt
    assert held_out["method"] == f"paired, {len(held_out_prompts(root))} items" and held_out["mcnemar_p"] is not None
    assert held_out["diff"] == pytest.approx(held_out["mean"] - base["mean"], abs=1e-3)
    assert compared["smol_arithmetic_gen"]["method"] == "standard errors", "8 eval items (evaluation.limit): too few to pair"
    assert "pretrain_phase1" in data["shared"] and data["differ"] == {"sft": 2}, "versions per step, not display strings"
    text = report.read_text()
    assert "Baseline: **slow**" in text and "95% interval" in text and (root / "report" / "scores.png").is_file()
    assert "## Which tasks carry signal" in text and data["audit"], "the early-signal checks over the runs' checkpoints"
    assert (root / "report" / "curves.png").is_file()  # the SFT loss curves of both variants
    assert data["alone_seconds"] > data["distinct_seconds"] > 0

    # a rerun builds nothing
    ablation_flow(str(path), str(root))
    assert len(built(root / "steps")) == len(builds)
    assert len(json.loads((root / "ablation.json").read_text())["wall_seconds"]) == 2  # the full build, then the rerun


def held_out_prompts(root: Path) -> list[str]:
    return (root / "slow" / "chat_data" / "heldout.jsonl").read_text().splitlines()


def test_scores_are_averaged_over_seeds_and_without_items_compared_by_their_standard_errors():
    from tasks.evaluation.compare import Row, Score, compare_rows, judge_only_usable

    row = Row("apo", "held-out", "accuracy")
    row.scores["a"] += [Score(0.50, 0.02), Score(0.54, 0.02)]
    row.scores["b"] += [Score(0.70, 0.02), Score(0.74, 0.02)]
    mean, se = row.summary("a")
    assert mean == pytest.approx(0.52) and se == pytest.approx((0.0008 / 2 + 0.0004 / 2) ** 0.5)
    two = {e["variant"]: e for e in compare_rows([row], ["a", "b"], "a")}["b"]
    # two seeds 0.04 apart: seeds alone move a 2-seed mean by up to t(0.975, 1) x 0.028 x 1 = 0.36 (5% of the time)
    assert two["method"] == "standard errors" and two["diff"] == pytest.approx(0.2) and two["verdict"] == "below the noise floor"
    assert two["noise_floor"] == pytest.approx(0.3594, abs=1e-4)
    row.scores["a"].append(Score(0.52, 0.02))
    row.scores["b"].append(Score(0.72, 0.02))
    three = {e["variant"]: e for e in compare_rows([row], ["a", "b"], "a")}["b"]
    assert three["verdict"] == "better" and three["noise_floor"] == pytest.approx(4.3027 * 0.02 * (2 / 3) ** 0.5, abs=1e-4)
    close = Row("apo", "held-out", "accuracy")
    close.scores["a"].append(Score(0.50, 0.05))
    close.scores["b"].append(Score(0.55, 0.05))
    assert compare_rows([close], ["a", "b"], "a")[1]["verdict"] == "within noise"
    ppl = Row("base", "smol_ppl_code", "bits_per_byte")
    ppl.scores["a"].append(Score(2.0, 0.01))
    ppl.scores["b"].append(Score(1.5, 0.01))
    verdict = compare_rows([ppl], ["a", "b"], "a")[1]["verdict"]
    assert verdict == "better (no noise floor: one baseline seed)"  # lower bits per byte is better; one seed measures no floor
    judged = judge_only_usable(compare_rows([row, ppl], ["a", "b"], "a"), {"smol_ppl_code"})  # as with evaluation.select: auto
    assert [e.get("verdict") for e in judged] == [None, "better", None, "not judged: no signal at this scale"]


def test_one_seed_takes_its_noise_floor_from_its_last_checkpoints_for_the_pretrained_model_only():
    import numpy as np

    from tasks.evaluation.compare import Row, Score, checkpoint_floors, compare_rows

    records = [  # the baseline's checkpoints: arithmetic cloze climbs, then jitters by ~0.015 over the last four
        {"model": {"kind": "checkpoint", "tokens": 100 * (i + 1)}, "tasks": {"smol_arithmetic_cf": {"metrics": {"acc": acc}}}}
        for i, acc in enumerate([0.20, 0.30, 0.40, 0.45, 0.50, 0.52, 0.49, 0.51])
    ]
    floors = checkpoint_floors(records, ["base"])
    x, y = np.array([500.0, 600, 700, 800]), np.array([0.50, 0.52, 0.49, 0.51])
    residuals = y - np.polyval(np.polyfit(x, y, 1), x)  # the jitter about the last four's trend, not their spread
    expected = 4.3027 * float(np.sqrt((residuals**2).sum() / 2)) * 2**0.5  # t(0.975, 2): two degrees spent on the line
    assert floors == {("base", "smol_arithmetic_cf", "acc"): pytest.approx(expected, abs=1e-4)}
    steady = [r | {"tasks": {"smol_arithmetic_cf": {"metrics": {"acc": 0.3 + 0.02 * i}}}} for i, r in enumerate(records)]
    assert checkpoint_floors(steady, ["base"]).get(("base", "smol_arithmetic_cf", "acc"), 0.0) < 1e-6, "a steady climb is no noise"
    assert checkpoint_floors(records[2:], ["base"]) == {}, "with 6 checkpoints the last 4 are still the climb: no floor"
    rows = []
    for model in ("base", "sft"):  # +0.05 with a tight interval: beyond 0, but not beyond the last checkpoints' jitter
        row = Row(model, "smol_arithmetic_cf", "acc")
        row.scores["a"].append(Score(0.51, 0.005))
        row.scores["b"].append(Score(0.56, 0.005))
        rows.append(row)
    base, sft = [e for e in compare_rows(rows, ["a", "b"], "a", floors) if e["variant"] == "b"]
    assert base["verdict"] == "below the noise floor" and base["floor_from"] == "last 4 checkpoints"
    assert sft["verdict"] == "better (no noise floor: one baseline seed)" and "floor_from" not in sft  # not a pretrained model
    assert compare_rows(rows, ["a", "b"], "a")[1]["verdict"] == "better (no noise floor: one baseline seed)"


def _right_or_wrong(correct) -> dict:
    return {f"q{i}": (float(c), 1.0) for i, c in enumerate(correct)}


def test_a_paired_comparison_finds_a_planted_effect_the_unpaired_interval_misses_and_calls_a_null_noise():
    import numpy as np

    from tasks.evaluation.stats import paired, verdict

    rng = np.random.default_rng(0)
    base = rng.random(400) < 0.5  # items of mixed difficulty: both variants get most of the same ones right
    better = base.copy()
    better[np.flatnonzero(~base)[:16]] = True  # 16 wrong answers made right: +4 points, nothing else changed
    found = paired([_right_or_wrong(base)], [_right_or_wrong(better)])
    assert found.diff == pytest.approx(0.04) and found.ci95[0] > 0 and found.mcnemar_p < 0.001
    assert found.unpaired_ci95[0] < 0 < found.unpaired_ci95[1], "ignoring the pairing, +4 points on 400 items is within noise"
    assert verdict(found.diff, found.ci95, None, lower_is_better=False).startswith("better")
    assert found.mde < 0.04 and found.items == 400
    shuffled = base.copy()
    flips = rng.choice(400, 40, replace=False)
    shuffled[flips] = ~shuffled[flips]  # as many answers changed each way as chance gives: no effect
    null = paired([_right_or_wrong(base)], [_right_or_wrong(shuffled)])
    assert null.ci95[0] < 0 < null.ci95[1] and null.mcnemar_p > 0.05
    assert verdict(null.diff, null.ci95, 0.01, lower_is_better=False) == "within noise"
    # beyond 0 but no larger than two seeds of the baseline differ: no verdict
    assert verdict(found.diff, found.ci95, 0.05, lower_is_better=False) == "below the noise floor"
    assert paired([_right_or_wrong(base[:5])], [_right_or_wrong(better[:5])]) is None, "too few items in common"
    few = base.copy()
    few[np.flatnonzero(~base)[:5]] = True  # 5 answers made right, none wrong: the bootstrap leaves out 0, McNemar does not
    small = paired([_right_or_wrong(base)], [_right_or_wrong(few)])
    assert small.ci95[0] > 0 and small.mcnemar_p == pytest.approx(0.0625)
    assert verdict(small.diff, small.ci95, None, False).startswith("better"), "the interval alone"
    assert verdict(small.diff, small.ci95, None, False, small.mcnemar_p) == "within noise"
    assert verdict(found.diff, found.ci95, None, False, found.mcnemar_p).startswith("better")


def test_bits_per_byte_are_compared_over_the_same_documents_weighted_by_their_bytes():
    import numpy as np

    from tasks.evaluation.compare import Row, Score, compare_rows

    rng = np.random.default_rng(1)
    size = rng.integers(200, 2000, 60).astype(float)
    hard = rng.uniform(1.0, 3.0, 60)  # bits per byte of each document under the baseline: documents differ a lot
    row = Row("base", "smol_ppl_math", "bits_per_byte")
    for _ in range(2):  # two seeds each
        jitter = rng.normal(0, 0.01, 60)
        for variant, shift in (("a", 0.0), ("b", -0.05)):  # b: 0.05 fewer bits per byte on every document
            bits = (hard + shift + jitter) * size
            items = {f"d{i}": (bits[i], size[i]) for i in range(60)}
            row.scores[variant].append(Score(float(bits.sum() / size.sum()), None, items))
    e = compare_rows([row], ["a", "b"], "a")[1]
    assert e["method"] == "paired, 60 items" and e["diff"] == pytest.approx(-0.05, abs=0.005) and e["ci95"][1] < 0
    assert e["unpaired_ci95"][0] < 0 < e["unpaired_ci95"][1], "documents vary more than the effect: only the pairing sees it"
    assert e["verdict"] == "better" and 0 < e["noise_floor"] < abs(e["diff"]), "two seeds measure a floor under the effect"
