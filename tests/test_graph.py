"""The step graph of a recipe: which steps a recipe change reruns, the dry run, one direction of imports.

The graph and its identities are the real ones (flows/graph.py over configs/micro.yaml); only each
step's function is swapped for one that writes its config and its inputs' fingerprints, so which
steps rebuild is decided exactly as in a real run, in a second instead of minutes.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows.graph import STAGES, build_graph
from infra.recipe import EvalCfg, parse_recipe
from infra.steps import identity, out_of_date, run_step
from tasks.evaluation.results import RESULTS, ModelRef, ResultStore, eval_key, keep_keys, run_results
from tests.helpers import REPO, micro_recipe, stand_in, write_recipe


def build_all(run_dir: Path, **changes) -> list[str]:
    """Run every step of the micro recipe's graph (with `changes`) with recording functions; returns what was built."""
    graph = build_graph(parse_recipe(micro_recipe(**changes), "micro"))
    built, outputs = [], {}

    def record(cfg, inputs, out, name):
        built.append(name)
        (out / "out.json").write_text(json.dumps([identity(cfg), {k: v.fingerprint for k, v in sorted(inputs.items())}], sort_keys=True))
        return {}

    for step in graph.steps:
        fake = dataclasses.replace(step, fn=lambda cfg, inputs, out, name=step.name: record(cfg, inputs, out, name))
        outputs[step.name] = run_step(run_dir, fake, {role: outputs[d.name] for role, d in step.deps.items()})
    return built


@pytest.fixture(scope="module")
def everything(tmp_path_factory) -> tuple[Path, list[str]]:
    run_dir = tmp_path_factory.mktemp("graph")
    return run_dir, build_all(run_dir)


POST = ["sft", "preference", "apo", "grpo"]
PRETRAIN = ["pretrain_phase1", "pretrain_phase2", "pretrain_phase3", "pretrain_long_context"]


def test_the_graph_of_the_micro_recipe(everything):
    _, built = everything
    curate = ["corpus", "ingest", "filter", "dedup", "decontaminate", "tokenizer", "tokenize", "mixtures"]
    assert built == curate + PRETRAIN + ["chat_data"] + POST


def test_operational_values_rerun_nothing(everything):
    run_dir, _ = everything
    operational = {
        "pretrain.launcher": {"kind": "torchrun", "nproc": 2, "threads_per_rank": 1},
        "pretrain.micro_batch_size": 2,
        "pretrain.checkpoint": {"every_steps": 7, "every_minutes": 1, "keep_last": 5},
        "pretrain.log_every": 1,
        "pretrain.tracking": "trackio",
        "pretrain.hardware": {"name": "H100", "peak_tflops": 900},
        "pretrain.parallel": {"dp": 8, "tp": 1, "pp": 1},
        "executor.workers": 2,
        "executor.kind": "ray",
        "storage.s3": {"endpoint_url": "http://127.0.0.1:9"},
        "curate.strict": True,
        "curate.examples_per_filter": 9,
        "postrain.sft.save_steps": 7,
        "postrain.grpo.logging_steps": 1,
        "postrain.heldout_eval.batch_size": 3,
        "postrain.preference.batch_size": 3,
        "evaluation.threads": 2,
        "evaluation.poll_seconds": 1,
    }
    assert build_all(run_dir, **operational) == []


@pytest.mark.parametrize(
    "change, rebuilt",
    [
        # curate: a dedup setting reruns dedup and everything after it, not ingest or filter
        ({"curate.dedup.minhash.buckets": 10}, ["dedup", "decontaminate", "tokenizer", "tokenize", "mixtures", *PRETRAIN, *POST]),
        # pretrain: the long-context phase's RoPE base reruns that phase and post-training only
        ({"pretrain.phases.3.rope_theta": 200000}, ["pretrain_long_context", *POST]),
        # pretrain: a phase's budget changes the mixtures, every phase (the schedule is global) and what follows
        ({"pretrain.phases.1.tokens": 3000}, ["mixtures", *PRETRAIN, *POST]),
        # post-training: APO's beta reruns APO and GRPO only
        ({"postrain.apo.beta": 0.2}, ["apo", "grpo"]),
        # a trainer's seed written out as the recipe's (the value it falls back to) is the same step; another one is not
        ({"postrain.apo.seed": 1234, "pretrain.seed": 1234}, []),
        ({"postrain.apo.seed": 1235}, ["apo", "grpo"]),
        # post-training: the held-out evaluation settings are read by every step that scores its model
        ({"postrain.heldout_eval.max_new_tokens": 32}, POST),
    ],
)
def test_a_value_reruns_exactly_the_steps_that_read_it_and_their_downstream(tmp_path, change, rebuilt):
    build_all(tmp_path)
    assert build_all(tmp_path, **change) == rebuilt


def test_evaluation_results_are_keyed_by_what_changes_a_score_and_each_key_keeps_its_own(tmp_path):
    """The eval family: the item limit re-scores, threads or niceness do not; a score under another limit is kept
    beside the first, so a run that goes back to the first limit scores nothing again."""
    store = ResultStore(str(tmp_path))
    model = ModelRef(str(tmp_path), "fp", "phase1/step00000005", "checkpoint", "phase1")
    base = EvalCfg(checkpoint_tasks=["smol_arithmetic_cf"], limit=8)
    store.put(model, {"smol_arithmetic_cf": {"acc": 0.25}}, {"smol_arithmetic_cf": eval_key(base)}, 8, 1.0)
    for same in (base.model_copy(update={"threads": 2, "nice": 0, "batch_size": 4, "poll_seconds": 1}),):
        assert store.pending(model, ["smol_arithmetic_cf"], {"smol_arithmetic_cf": eval_key(same)}) == []
    for other in (base.model_copy(update={"limit": 16}), base.model_copy(update={"max_length": 64})):
        assert store.pending(model, ["smol_arithmetic_cf"], {"smol_arithmetic_cf": eval_key(other)}) == ["smol_arithmetic_cf"]
    keys = {limit: {"smol_arithmetic_cf": eval_key(base.model_copy(update={"limit": limit}))} for limit in (8, 16)}
    store.put(model, {"smol_arithmetic_cf": {"acc": 0.5}}, keys[16], 16, 1.0)
    assert store.pending(model, ["smol_arithmetic_cf"], keys[8]) == [], "the limit-8 score is still there"
    assert [store.get("fp", keys[limit])["tasks"]["smol_arithmetic_cf"]["metrics"]["acc"] for limit in (8, 16)] == [0.25, 0.5]
    # a run reads the score of the key its evaluations scored under, not the newest: back at limit 8, 0.25
    run = tmp_path / "run"
    (run / RESULTS).parent.mkdir(parents=True)
    (run / RESULTS).symlink_to(tmp_path)  # as an ablation's run links a shared store
    for limit, acc in ((8, 0.25), (16, 0.5), (8, 0.25)):
        keep_keys(run, keys[limit])
        [listed] = run_results(run).all()
        for record in (listed, run_results(run).get("fp")):
            assert record["tasks"]["smol_arithmetic_cf"]["metrics"]["acc"] == acc, limit


def test_dry_run_names_the_changed_keys_and_runs_nothing(everything):
    run_dir, _ = everything
    recipe = write_recipe(run_dir.parent / "micro-dry.yaml", micro_recipe())
    before = {p: p.stat().st_mtime for p in run_dir.rglob("manifest.json")}
    (run_dir / "recipe.json").write_text(json.dumps(parse_recipe(micro_recipe(), "m").model_dump(mode="json")))
    smolflow = str(Path(sys.executable).parent / "smolflow")
    args = ["--run-dir", str(run_dir), "--set", "postrain.apo.beta=0.2", "--set", "pretrain.launcher.threads_per_rank=2", "--dry-run"]
    out = subprocess.run([smolflow, "run", str(recipe), *args], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "postrain.apo.beta: 0.1 -> 0.2" in text and "pretrain.launcher.threads_per_rank: 1 -> 2   (operational: reruns nothing)" in text
    assert "  cached   sft" in text and "  rerun    apo" in text and "apo.beta: 0.1 -> 0.2" in text
    assert "  rerun    grpo  (after apo)" in text and "2 of 17 steps would run; 15 cached." in text
    assert {p: p.stat().st_mtime for p in run_dir.rglob("manifest.json")} == before
    frozen = json.loads((run_dir / "recipe.json").read_text())
    assert frozen["postrain"]["apo"]["beta"] == 0.1, "a dry run freezes nothing"
    # one stage on an input the change made stale: its dry run plans it and ends with the refusal its run gives
    out = subprocess.run([smolflow, "stage", "grpo", str(recipe), *args], capture_output=True, text=True, cwd=REPO)
    assert "  rerun    grpo  (after apo)" in out.stdout and out.returncode == 2, out.stdout + out.stderr
    assert "grpo needs step 'apo', whose output" in out.stderr and "out of date with the recipe (apo.beta: 0.1 -> 0.2)" in out.stderr
    assert out.stderr.count("postrain.apo.beta changed") == 1, "the run dir is opened once: its recipe change is logged once"


# modules allowed an import whose name is not a literal, each with what names it (checked by its own test)
DYNAMIC = {"postrain/run.py": "the trainer registry, TrainerCfg.trainer"}


def _callee(call: ast.Call) -> str:
    return getattr(call.func, "id", "") or getattr(call.func, "attr", "")  # f() or module.f()


def _imports(folder: str) -> set[str]:
    """Top-level packages FOLDER imports: statements, and `__import__` / `importlib.import_module` calls (a literal
    name counts as that import; any other is `<dynamic>` unless DYNAMIC names the module)."""
    found = set()
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.Call) and _callee(node) in ("__import__", "import_module"):
                name = node.args[0] if node.args else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    found.add(name.value.split(".")[0])
                elif path.relative_to(REPO).as_posix() not in DYNAMIC:
                    found.add("<dynamic>")
    return found


def test_layers_point_one_way():
    assert not _imports("infra") & {"flows", "tasks", "model", "postrain", "bench", "tests", "<dynamic>"}
    for stage_library in ("model", "postrain"):
        assert not _imports(stage_library) & {"flows", "tasks", "bench", "tests", "<dynamic>"}, stage_library
    assert not _imports("tasks") & {"flows", "bench", "tests", "<dynamic>"}
    assert not _imports("bench") & {"tests"}


def test_the_layering_check_sees_importlib_calls(tmp_path, monkeypatch):
    import tests.test_graph as me

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "m.py").write_text("import importlib\nimportlib.import_module('flows.cli')\nimportlib.import_module(f'x{1}')\n")
    monkeypatch.setattr(me, "REPO", tmp_path)
    assert _imports("lib") >= {"flows", "<dynamic>"}


def test_the_results_tables_are_rendered_from_the_record_and_a_measured_run_becomes_a_row(tmp_path, monkeypatch):
    """docs/results.md's tables are bench/record.py's rendering of docs/results.jsonl, never typed by hand."""
    from bench import record

    doc = record.DOC.read_text()
    assert record.with_tables(doc, record.load()) == doc, "docs/results.md's tables differ from the record: `python bench/record.py`"
    monkeypatch.setattr(record, "RECORDS", tmp_path / "results.jsonl")
    monkeypatch.setattr(record, "DOC", tmp_path / "results.md")
    record.DOC.write_text(doc)
    side = {"commit": "abc1234def", "result": "2 failed, 10 passed, 3 warnings in 600.0s", "wall_s": 600.2, "cpu_s": 1080.4}
    record.append(record.suite_record(side, "2031-01-02"))
    rows = [line for line in record.DOC.read_text().splitlines() if line.startswith("| 2031-01-02 |")]
    assert len(rows) == 1 and rows[0].startswith("| 2031-01-02 | abc1234 | ")
    assert rows[0].endswith("| 10 passed, 2 failed | 10.0 min | 1,080 s | 90.0 s |"), rows


def test_the_trainer_registry_names_functions_of_the_post_training_library():
    from infra.recipe import PostrainCfg

    for name, cfg in PostrainCfg.trainer_types().items():
        module, function = cfg.trainer.split(":")
        path = REPO / (module.replace(".", "/") + ".py")
        assert module.split(".")[0] == "postrain" and path.is_file(), (name, cfg.trainer)
        assert function in {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}, (name, cfg.trainer)


@pytest.mark.parametrize(
    "modules",
    [
        # every CLI command and Prefect flow process imports the graph
        "flows.cli, flows.pipeline",
        # each curation task on Slurm or Ray is a fresh process that unpickles its pipeline, importing this module
        "tasks.curation.pipelines",
    ],
)
def test_short_lived_processes_import_no_training_library(modules):
    """torch, transformers, datasketch and deepspeed belong to the trainer, generation and eval processes; each costs
    a process seconds of CPU before it does anything (~10 s for transformers' model code on 2 cores)."""
    code = f"import sys, {modules}; print(sorted({{'torch', 'transformers', 'datasketch', 'deepspeed'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.split() == ["[]"], out.stdout + out.stderr


@pytest.mark.parametrize(
    "command",
    ["validate configs/micro.yaml", "run configs/micro.yaml --dry-run", "stage sft configs/micro.yaml --dry-run"],
)
def test_commands_that_run_no_flow_import_no_prefect(command, tmp_path):
    """Checking a recipe, a dry run and a refused stage only read the recipe and the run dir: Prefect (with pandas, ~2
    CPU s; `smolflow validate` took 4.5 CPU s, 2 without it) is imported once a flow runs (tasks.common `DeferredTask`)."""
    args = command.split() + (["--run-dir", str(tmp_path / "run")] if "dry-run" in command else [])
    code = (
        f"import sys\nfrom flows.cli import app\ntry:\n    app({args!r})"
        "\nfinally:\n    print('prefect' in sys.modules, 'pandas' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    said = out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "False False", said
    if command.startswith("stage"):  # refused: the micro run dir holds no pretrained model yet
        assert out.returncode == 2 and "run      sft" in out.stdout and "smolflow stage pretrain" in out.stderr, said
    else:
        assert out.returncode == 0 and ("valid recipe" in out.stdout or "steps would run" in out.stdout), said


def test_a_report_rebuilt_outside_a_run_publishes_no_artifact_and_starts_no_prefect(tmp_path):
    """`smolflow ablate --report` and `swarm --report` write their report outside a flow run: its artifacts would belong
    to no run (deprecated by Prefect) and started Prefect's temporary server to hold them."""
    code = (
        f"import sys, pathlib; from tasks.evaluation.plots import artifact, table_artifact; "
        f"artifact('# r', pathlib.Path({str(tmp_path)!r}), 'r', 'd'); table_artifact([{{'a': 1}}], 'r-t', 'd'); "
        "print('prefect' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stdout + out.stderr


def test_the_flow_process_measures_its_matmul_peak_with_torch_alone(tmp_path):
    """The MFU probe runs in the flow process before a run's first trainer: torch, never transformers' model code."""
    code = (
        f"import sys, pathlib; from tasks.pretrain import store_peak_flops; store_peak_flops(pathlib.Path({str(tmp_path)!r}), 1, 'p'); "
        "print(sorted({'torch', 'transformers', 'deepspeed'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.split() == ["['torch']"], out.stdout + out.stderr
    assert (tmp_path / "peak_flops.json").is_file()


# words that are also a step's name, where they mean something else
HOMONYMS = {"tasks/evaluation/harness.py": {"filter"}}  # the key of an lm-eval logged sample naming its output filter


def test_step_names_are_spelled_only_in_the_graph_module():
    """Stage names (flows, CLI, deployments) are another concept; a stage of one step shares its spelling."""
    graph = build_graph(parse_recipe(micro_recipe(), "micro"))
    names = {s.name for s in graph.steps} - set(STAGES) - {s.name for s in graph.phases}  # phases: user-named
    for folder in ("infra", "model", "postrain", "tasks", "flows"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "graph.py":
                continue
            tree = ast.parse(path.read_text())
            literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            spelled = literals & names - HOMONYMS.get(path.relative_to(REPO).as_posix(), set())
            assert not spelled, f"{path.relative_to(REPO)} spells step names {sorted(spelled)}"


def test_every_cli_command_that_runs_a_flow_starts_its_reaper_first():
    """A command that calls a flow in its own process marks its tree (`runs_flows`) before Prefect starts a
    temporary server, or that server outlives a killed CLI, and calls it through `_start`, or that server shares
    the CLI's session and a Ctrl-C stops it under the flow; checked here, so a new command cannot forget either."""
    import importlib

    from prefect import Flow

    flows = set()  # the names under which the flows modules hold flows (a dict of them included)
    for module in ("flows.pipeline", "flows.ablation", "flows.swarm", "flows.relaunch"):
        for name, value in vars(importlib.import_module(module)).items():
            if any(isinstance(v, Flow) for v in (value.values() if isinstance(value, dict) else [value])):
                flows.add(name)
    functions = {f.name: f for f in ast.parse((REPO / "flows" / "cli.py").read_text()).body if isinstance(f, ast.FunctionDef)}

    def names(f: ast.FunctionDef) -> set[str]:
        used = {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
        return used | {a.name for n in ast.walk(f) if isinstance(n, ast.ImportFrom) for a in n.names}

    running = {name for name, f in functions.items() if names(f) & flows}
    while more := {name for name, f in functions.items() if names(f) & running} - running:  # through helpers
        running |= more
    commands = {name for name, f in functions.items() if any("command" in ast.unparse(d) for d in f.decorator_list)}
    unmarked = [n for n in sorted(running & commands) if "runs_flows" not in {ast.unparse(d) for d in functions[n].decorator_list}]
    assert running & commands and not unmarked, f"CLI commands that run flows without @runs_flows: {unmarked}"
    tree = ast.parse((REPO / "flows" / "cli.py").read_text())
    direct = [
        ast.unparse(c)
        for c in ast.walk(tree)
        if isinstance(c, ast.Call) and {n.id for n in ast.walk(c.func) if isinstance(n, ast.Name)} & flows
    ]
    assert not direct, f"flows called other than through `_start`: {direct}"


def test_prefect_yaml_deploys_every_stage_of_the_graph():
    from prefect import Flow

    import flows.pipeline as pipeline

    text = (REPO / "prefect.yaml").read_text()
    assert pipeline.stage_deployments(text) == text, "prefect.yaml's stage deployments are stale: run `smolflow deployments --write`"
    deployed = [line.split("flows/pipeline.py:")[1].split(",")[0] for line in text.splitlines() if "flows/pipeline.py:" in line]
    flows = [getattr(pipeline, name) for name in deployed if name.endswith("_flow") and name != "scheduled_eval_flow"]
    assert all(isinstance(f, Flow) for f in flows) and [f.name for f in flows] == list(STAGES)


TOY_TRAINER = '''"""A toy trainer: starts from its model and leaves it as is (a test of what a new trainer touches)."""

import shutil


def run_toy(model, rows, cfg, out, seed):
    shutil.copytree(model, out / "final")
    return {"rows": len(rows)}
'''


def test_a_stage_rebuilt_alone_leaves_the_later_steps_out_of_date_and_its_log_and_the_card_say_so(tmp_path, monkeypatch, caplog):
    """`smolflow stage apo` with another beta: GRPO, still linked, was built on the APO model it replaced."""
    import flows.pipeline as pipeline
    from tasks.evaluation.report import build_report

    run_dir = tmp_path / "run"
    build_all(run_dir)
    before = build_graph(parse_recipe(micro_recipe(), "micro"))
    assert out_of_date(run_dir, before.steps) == [] and "Out of date" not in build_report(run_dir, "micro", before.steps).markdown
    graph = build_graph(parse_recipe(micro_recipe(**{"postrain.apo.beta": 0.2}), "micro"))
    assert [(s.step.name, s.why()) for s in out_of_date(run_dir, graph.steps)] == [("apo", "apo.beta: 0.1 -> 0.2"), ("grpo", "after apo")]

    def recorded(run, stage, graph, available):  # the stage's steps with recording functions, decided as in a real run
        built = dict(available)
        for step in graph.stage(stage):
            built[step.name] = run.build(stand_in(step), {role: built[d.name] for role, d in step.deps.items()})
        return {step.name: built[step.name] for step in graph.stage(stage)}

    monkeypatch.setattr(pipeline, "run_steps", recorded)
    recipe = write_recipe(tmp_path / "micro.yaml", micro_recipe())
    with caplog.at_level("WARNING", logger="smolflow"):
        pipeline.run_stage("apo", str(recipe), str(run_dir), ["postrain.apo.beta=0.2"], evals=False)
    assert [(s.step.name, s.why()) for s in out_of_date(run_dir, graph.steps)] == [("grpo", "inputs changed: policy")]
    said = [r.getMessage() for r in caplog.records if "out of date now" in r.getMessage()]
    rebuild = f"`smolflow run {run_dir / 'recipe.json'} --run-dir {run_dir}`"
    assert said == [said[0]] and said[0].startswith(f"grpo is out of date now (inputs changed: policy): {rebuild}")
    card = build_report(run_dir, "micro", graph.steps).markdown
    assert "**Out of date with the run's recipe:** grpo (inputs changed: policy). Their figures below" in card
    assert f"{rebuild} rebuilds them on that recipe." in card


FAKE_BUILD = """
import sys
from pathlib import Path
from flows.graph import build_graph
from infra.recipe import load_recipe
from infra.steps import run_step
from tasks.evaluation.report import build_report
from tests.helpers import stand_in

graph = build_graph(load_recipe("configs/micro.yaml"))
outputs, run_dir = {}, Path(sys.argv[1])
for step in graph.steps:
    outputs[step.name] = run_step(run_dir, stand_in(step), {role: outputs[d.name] for role, d in step.deps.items()})
print(build_report(run_dir, "micro", graph.steps).markdown)
"""


def test_a_new_post_training_trainer_takes_three_files_and_reaches_every_part(tmp_path):
    """A toy trainer added the way flows/graph.py says (its module, its recipe section, one graph line and its stage)
    is in the dry run, `smolflow stage`, the planner, the report card and the deployments, with nothing else edited."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True).stdout.split()
    copy = tmp_path / "repo"
    for rel in files:
        if (REPO / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            (copy / rel).write_bytes((REPO / rel).read_bytes())
    (copy / "postrain" / "toy.py").write_text(TOY_TRAINER)
    recipe = copy / "infra" / "recipe.py"
    text = recipe.read_text().replace(
        "class PostrainCfg(Strict):",
        'class ToyCfg(TrainerCfg):\n    trainer: ClassVar[str] = "postrain.toy:run_toy"\n\n\nclass PostrainCfg(Strict):',
    )
    section = "    toy: ToyCfg = ToyCfg(learning_rate=1e-3, max_steps=1)\n"
    recipe.write_text(text.replace("    grpo: GRPOCfg\n", "    grpo: GRPOCfg\n" + section, 1))
    graph = copy / "flows" / "graph.py"
    text = graph.read_text().replace('"grpo", EVALUATE)', '"grpo", "toy", EVALUATE)')
    line = '    add(postrain.trained(recipe, "toy", {"chats": chats, "policy": sft}))\n'
    graph.write_text(text.replace("    curation = {", line + "    curation = {", 1))
    smolflow = [sys.executable, "-m", "flows.cli"]

    def run(*args: str) -> str:
        out = subprocess.run([*smolflow, *args], cwd=copy, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    run_dir = str(tmp_path / "run")
    assert "  run      toy" in run("run", "configs/micro.yaml", "--run-dir", run_dir, "--dry-run")
    # the stage's dry run plans toy and ends with the refusal its run gives: nothing upstream is built yet
    stage = subprocess.run(
        [*smolflow, "stage", "toy", "configs/micro.yaml", "--run-dir", run_dir, "--dry-run"], cwd=copy, capture_output=True, text=True
    )
    assert "  run      toy" in stage.stdout and stage.returncode == 2 and "toy needs the output of step" in stage.stderr, stage.stderr
    assert "  toy: 1 rank(s)" in run("plan", "configs/micro.yaml")
    assert "entrypoint: flows/pipeline.py:toy_flow" in run("deployments")
    card = subprocess.run([sys.executable, "-c", FAKE_BUILD, run_dir], cwd=copy, capture_output=True, text=True)
    assert card.returncode == 0, card.stderr
    assert "toy" in card.stdout.split("steps finished**")[1].split("\n")[0], "the report card lists the toy step"
