"""Recipe validation: every mistake names the file and the dotted key."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.recipe import RecipeError, load_recipe
from tests.helpers import REPO, micro_recipe, write_recipe


def error_for(tmp_path, **changes) -> str:
    path = write_recipe(tmp_path / "bad.yaml", micro_recipe(**changes))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    return str(err.value)


def test_shipped_recipes_validate():
    tiny = load_recipe(REPO / "configs" / "tiny.yaml")
    real = load_recipe(REPO / "configs" / "smollm3-3b.yaml")
    assert [s.name for s in tiny.pretrain.phases][:3] == ["phase1", "phase2", "phase3"]
    assert real.pretrain.phases[0].tokens == 8 * 10**12
    assert any(s.path.startswith("hf://datasets/") for s in real.sources)


def test_misspelt_key_names_file_and_path(tmp_path):
    data = micro_recipe()
    data["curate"]["dedup"]["minhash"]["bucketz"] = 3
    path = write_recipe(tmp_path / "typo.yaml", data)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(path) in str(err.value)
    assert "curate.dedup.minhash.bucketz: unknown key" in str(err.value)


def test_wrong_type_names_list_index(tmp_path):
    msg = error_for(tmp_path, **{"sources.1.limit": "many"})
    assert "sources[1].limit" in msg


def test_weights_must_sum_to_one(tmp_path):
    msg = error_for(tmp_path, **{"pretrain.phases.0.mixture": {"prose": 0.5, "code": 0.2, "math": 0.1}})
    assert "pretrain.phases[0]" in msg and "sum to 0.8" in msg


def test_phase_without_tokens(tmp_path):
    msg = error_for(tmp_path, **{"pretrain.phases.1.tokens": 0})
    assert "pretrain.phases[1].tokens" in msg


def test_mixture_names_unknown_source(tmp_path):
    msg = error_for(tmp_path, **{"pretrain.phases.2.mixture": {"prose": 0.5, "web": 0.5}})
    assert "unknown source 'web'" in msg


def test_filter_parameter_checked_against_datatrove(tmp_path):
    """The schema knows filter names; their parameters are checked by the curation code when the graph is built
    (`smolflow validate` and every run do so before anything runs)."""
    import subprocess
    import sys

    data = micro_recipe()
    data["curate"]["filters"]["prose"]["gopher_quality"] = {"min_doc_wordz": 10}
    data["curate"]["filters"]["prose"]["c4_badwords"] = {"badwords_path": "words.txt", "keep_fraction": 0.1}  # a subclass's parent
    path = write_recipe(tmp_path / "f.yaml", data)
    out = subprocess.run([str(Path(sys.executable).parent / "smolflow"), "validate", str(path)], capture_output=True, text=True, cwd=REPO)
    assert (
        out.returncode == 2
        and "curate.filters.prose.gopher_quality: filter 'gopher_quality' has no parameter 'min_doc_wordz'" in out.stderr
    )
    assert "c4_badwords" not in out.stderr


def test_filter_needing_an_asset_fails_at_validation(tmp_path):
    data = micro_recipe()
    data["curate"]["filters"]["prose"]["language"] = {"languages": ["en"]}
    path = write_recipe(tmp_path / "lid.yaml", data)
    with pytest.raises(RecipeError, match=r"language.*model_path.*local path or s3://"):
        load_recipe(path)


def test_domain_without_filter_set(tmp_path):
    data = micro_recipe()
    del data["curate"]["filters"]["math"]
    path = write_recipe(tmp_path / "d.yaml", data)
    with pytest.raises(RecipeError, match=r"domain 'math' has no filter set"):
        load_recipe(path)


def test_tokenizer_path_must_be_the_json_file(tmp_path):
    msg = error_for(tmp_path, **{"curate.tokenizer": {"path": "/models/smollm3"}})
    assert "tokenizer.json itself" in msg


def test_overrides_and_token_suffixes(tmp_path):
    path = write_recipe(tmp_path / "ok.yaml", micro_recipe())
    recipe = load_recipe(path, ["pretrain.phases.0.tokens=1.5M", "curate.strict=true"])
    assert recipe.pretrain.phases[0].tokens == 1_500_000
    assert recipe.curate.strict is True
    with pytest.raises(RecipeError, match="no item 9"):
        load_recipe(path, ["sources.9.name=x"])


def test_secrets_are_masked_in_dumps(tmp_path):
    from infra.recipe import recipe_dump

    path = write_recipe(tmp_path / "s.yaml", micro_recipe(**{"storage": {"s3": {"key": "AKIA", "secret": "hunter2"}}}))
    dumped = str(recipe_dump(load_recipe(path)))
    assert "hunter2" not in dumped and "AKIA" not in dumped


def test_the_deployment_schema_refuses_every_override_the_flow_refuses_as_a_secret(tmp_path):
    """The flows' `overrides` schema (infra/recipe.py `Override`, checked by the Prefect server before it stores a run) and
    apply_override agree on what sets a secret, for every secret field the schema has, directly or through a mapping."""
    import re

    from pydantic import TypeAdapter

    from infra.recipe import Override, secret_keys

    pattern = TypeAdapter(Override).json_schema()["not"]["pattern"]
    path = write_recipe(tmp_path / "ok.yaml", micro_recipe())
    assert secret_keys() == ["storage.s3.key", "storage.s3.secret"]
    secrets = [f"{k}=x" for k in secret_keys()] + ["storage.s3={endpoint: http://h, secret: x}", "storage={s3: {key: x}}"]
    plain = ["storage.s3.endpoint=http://keyhost:9", "storage.s3={endpoint: http://h}", "postrain.apo.beta=0.2", "@overlay.yaml"]
    for override in secrets:
        assert re.search(pattern, override), override
        with pytest.raises(RecipeError, match="credentials are never given as overrides"):
            load_recipe(path, [override])
    assert not any(re.search(pattern, override) for override in plain)


def test_global_batch_must_split_into_micro_batches(tmp_path):
    msg = error_for(tmp_path, **{"pretrain.phases.3.batch_size": 3})
    assert "phases[3] (long_context): batch_size 3 is not a multiple of micro_batch_size 2" in msg


def test_operational_keys_are_known_from_the_schema():
    from infra.recipe import operational_key

    assert operational_key("pretrain.launcher.nproc") and operational_key("pretrain.phases.0.micro_batch_size")
    assert operational_key("storage.s3.endpoint_url") and operational_key("evaluation.threads")
    assert not operational_key("pretrain.phases.0.tokens") and not operational_key("postrain.apo.beta")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(tmp_path / "broken.yaml")


def test_an_overlay_is_a_yaml_file_and_no_error_quotes_a_files_contents(tmp_path):
    """`@~/.aws/credentials` as an overlay once printed the key id; in a deployment run it lands in the database."""
    secret = "AKIAQUOTEDNEVER12345"
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = {secret}\n")
    with pytest.raises(RecipeError, match="an overlay is a .yaml or .yml file") as refused:
        load_recipe(REPO / "configs" / "micro.yaml", [f"@{credentials}"])
    (tmp_path / "keys.yaml").write_text(f"storage.mirror: s3://b\n  key: {secret}: x\n")
    with pytest.raises(RecipeError, match=r"keys.yaml: not valid YAML at line 2, column \d+") as broken:
        load_recipe(REPO / "configs" / "micro.yaml", [f"@{tmp_path / 'keys.yaml'}"])
    assert secret not in str(refused.value) + str(broken.value)


def test_a_model_task_that_would_fill_the_pretrained_models_context_is_refused_before_anything_runs(tmp_path):
    """micro's phase 1 alone exports a 64-token model and its generative task may write 64 tokens: lm-eval asserted
    that only when it scored the model, after training; the graph refuses it, naming the key and the phase."""
    from flows.graph import build_graph
    from tasks.evaluation.harness import generated_tokens

    micro, short = REPO / "configs" / "micro.yaml", ["pretrain.until_phase=phase1"]
    with pytest.raises(RecipeError, match=r"model_tasks: smol_arithmetic_gen generates up to 64 tokens.* 64-token .*length of phase1;"):
        build_graph(load_recipe(micro, short))
    build_graph(load_recipe(micro, [*short, "evaluation.model_tasks=[]"]))  # nothing generates
    build_graph(load_recipe(micro, [*short, "evaluation.max_length=128"]))  # the context lm-eval is given
    # a task of the user's (a tag lm-eval knows, an include) that sets no max_gen_toks: lm-eval's 256 tokens
    (tmp_path / "_gen.yaml").write_text("output_type: generate_until\nprocess_results: !function utils.score\n")
    (tmp_path / "mine.yaml").write_text("task: mine\ninclude: _gen.yaml\n")
    assert generated_tokens([str(tmp_path)], "mine") == 256 and generated_tokens([str(tmp_path)], "hellaswag") is None
    tasks = [f"evaluation.task_dirs=[{tmp_path}]", "evaluation.model_tasks=[mine]", "evaluation.checkpoint_tasks=[]"]
    with pytest.raises(RecipeError, match=r"mine generates up to 256 tokens.* 256-token .*long_context x YaRN 2"):
        build_graph(load_recipe(micro, tasks))  # micro as shipped: 128 tokens x 2
