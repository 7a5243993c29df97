"""Bad input gets a clear message naming the source, file and line; nothing is dropped silently."""

from __future__ import annotations

import gzip
import json

import pytest

from infra.errors import DataError
from infra.recipe import parse_recipe
from tasks.curation import pipelines
from tests.helpers import micro_recipe, write_jsonl

GOOD = "A perfectly ordinary document with enough words to be kept by every filter in this test."


def ingest(recipe, paths, out):
    return pipelines.ingest(recipe.sources, paths, recipe.executor, recipe.storage.s3, recipe.curate.strict, out)


def recipe_for(path, strict=False, fmt="jsonl", endpoint=None):
    data = micro_recipe(**{"curate.strict": strict})
    data["sources"] = [{"name": "raw", "domain": "web", "format": fmt, "path": str(path)}]
    data["curate"]["filters"] = {"web": {}}
    if endpoint:
        data["storage"] = {"s3": {"endpoint_url": endpoint}}
    for stage in data["pretrain"]["phases"]:
        stage["mixture"] = {"raw": 1.0}
    return parse_recipe(data, "test")


@pytest.fixture
def messy(tmp_path):
    raw = tmp_path / "raw"
    write_jsonl(
        raw / "a.jsonl",
        [
            {"id": "1", "text": GOOD},
            '{"id": "2", "text": "unterminated',
            {"id": "3", "text": GOOD + " 3"},
            {"id": "4", "body": "no text field"},
            {"id": "5", "text": ""},
        ],
    )
    (raw / "b.jsonl").write_bytes(b'{"id": "6", "text": "caf\xe9 latin-1 bytes"}\n' + (f'{{"id": "7", "text": "{GOOD} 7"}}\n').encode())
    (raw / "empty.jsonl").write_text("")
    return raw


def test_malformed_records_are_skipped_counted_and_located(messy, tmp_path):
    summary = ingest(recipe_for(messy), {"raw": str(messy)}, tmp_path / "out")
    s = summary["sources"]["raw"]
    assert (s["files"], s["docs"], s["malformed"]) == (3, 3, 5)
    where = {(e["file"], e["line"]) for e in pipelines.read_errors(tmp_path / "out" / "errors" / "raw", 10)}
    assert where == {("a.jsonl", 2), ("a.jsonl", 4), ("a.jsonl", 5), ("b.jsonl", 1), ("empty.jsonl", None)}
    errors = {(e["file"], e["line"]): e["error"] for e in pipelines.read_errors(tmp_path / "out" / "errors" / "raw", 10)}
    assert "not valid JSON" in errors[("a.jsonl", 2)]
    assert "'text' is missing" in errors[("a.jsonl", 4)]
    assert "empty file" == errors[("empty.jsonl", None)]


def test_strict_mode_fails_with_file_and_line(messy, tmp_path):
    with pytest.raises(DataError, match=r"source 'raw': a.jsonl:2: not valid JSON"):
        ingest(recipe_for(messy, strict=True), {"raw": str(messy)}, tmp_path / "out")


def test_non_utf8_text_file_is_located(tmp_path):
    raw = tmp_path / "txt"
    raw.mkdir()
    (raw / "good.txt").write_text(GOOD)
    (raw / "bad.txt").write_bytes(b"line one\nline two \xff\xfe here\n")
    summary = ingest(recipe_for(raw, fmt="text"), {"raw": str(raw)}, tmp_path / "out")
    assert summary["sources"]["raw"]["docs"] == 1
    [err] = pipelines.read_errors(tmp_path / "out" / "errors" / "raw", 10)
    assert (err["file"], err["line"]) == ("bad.txt", 2) and "not UTF-8" in err["error"]


def test_parquet_without_text_column_names_the_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = tmp_path / "pq"
    raw.mkdir()
    pq.write_table(pa.table({"id": ["1"], "content": [GOOD]}), raw / "x.parquet")
    with pytest.raises(DataError, match=r"x.parquet: no column 'text'.*text_key"):
        ingest(recipe_for(raw, fmt="parquet"), {"raw": str(raw)}, tmp_path / "out")


def test_parquet_source_reads(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = tmp_path / "pq"
    raw.mkdir()
    pq.write_table(pa.table({"id": ["1", "2"], "text": [GOOD, GOOD + " two"]}), raw / "x.parquet")
    summary = ingest(recipe_for(raw, fmt="parquet"), {"raw": str(raw)}, tmp_path / "out")
    assert summary["sources"]["raw"]["docs"] == 2
    with gzip.open(next((tmp_path / "out").rglob("*.jsonl.gz")), "rt") as f:
        metadata = json.loads(f.readline())["metadata"]
    assert metadata["file"] == "x.parquet" and "file_path" not in metadata, "no absolute path: a step's id would depend on it"


def test_missing_source_and_empty_folder(tmp_path):
    with pytest.raises(DataError, match=r"source 'raw' \(.*nowhere\): no such file or folder"):
        ingest(recipe_for(tmp_path / "nowhere"), {"raw": str(tmp_path / "nowhere")}, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no files match"):
        ingest(recipe_for(tmp_path / "empty"), {"raw": str(tmp_path / "empty")}, tmp_path / "out")


def test_source_with_only_bad_records_fails(tmp_path):
    raw = write_jsonl(tmp_path / "raw" / "x.jsonl", ["not json", "{also not"])
    with pytest.raises(DataError, match=r"no usable documents in 1 file\(s\); 2 malformed"):
        ingest(recipe_for(raw.parent), {"raw": str(raw.parent)}, tmp_path / "out")


def test_unreachable_s3_endpoint_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    endpoint = "http://127.0.0.1:9"  # discard port: nothing listens
    with pytest.raises(DataError, match=r"cannot reach storage at http://127.0.0.1:9"):
        ingest(recipe_for("s3://bucket/raw", endpoint=endpoint), {"raw": "s3://bucket/raw"}, tmp_path / "out")


def test_everything_filtered_out_fails_with_counts(tmp_path, prefect_server):
    from prefect import flow

    raw = write_jsonl(tmp_path / "raw" / "x.jsonl", [{"id": str(i), "text": "too short"} for i in range(5)])
    data = micro_recipe()
    data["sources"] = [{"name": "raw", "domain": "web", "format": "jsonl", "path": str(raw.parent)}]
    data["curate"]["filters"] = {"web": {"length": {"min_chars": 1000}}}
    for stage in data["pretrain"]["phases"]:
        stage["mixture"] = {"raw": 1.0}
    from flows.graph import build_graph
    from infra.steps import Run
    from tasks.common import build
    from tests.helpers import write_recipe

    run = Run.open(str(write_recipe(tmp_path / "r.yaml", data)), str(tmp_path / "run"))
    graph = build_graph(run.recipe)
    ingest_step, filter_step = graph.curation["ingested"], graph.curation["filtered"]

    @flow
    def two_steps():
        return build(run, filter_step, {"docs": build(run, ingest_step, {})})

    with pytest.raises(DataError, match=r"every document was filtered out \(raw: 5 in, removed .*too_short.: 5"):
        two_steps()
    with gzip.open(next((tmp_path / "run" / ingest_step.name / "data" / "raw").glob("*.jsonl.gz")), "rt") as f:
        assert len(f.readlines()) == 5
    assert not (tmp_path / "run" / filter_step.name / "manifest.json").exists()


def test_a_run_dir_or_sbatch_option_that_would_change_a_batch_script_is_refused(tmp_path):
    """A newline in a run dir became a shell line of the job; `sbatch_args: {export: ALL,LD_PRELOAD=...}` was taken."""
    from infra import slurm
    from infra.errors import SmolflowError
    from infra.recipe import LauncherCfg, RecipeError

    launcher = LauncherCfg(kind="slurm")
    out = tmp_path / "run\ntouch owned" / "pretrain_phase1-ab12"
    with pytest.raises(SmolflowError, match=r"cannot stand in a Slurm batch script \(it contains '\\n', ' '\)"):
        slurm.batch_script(launcher, slurm.job_name(out), out / "slurm.log", "model.train", ["job.json"], out)
    script = slurm.batch_script(launcher, "n", tmp_path / "ok" / "slurm.log", "model.train", ["a b"], tmp_path / "ok")
    assert f"#SBATCH --output={tmp_path}/ok/slurm.log" in script and "'a b'" in script
    with pytest.raises(RecipeError, match="sbatch_args.export"):
        parse_recipe(micro_recipe(**{"pretrain.launcher.slurm.sbatch_args": {"export": "ALL,LD_PRELOAD=/tmp/x.so"}}), "micro")
