"""Model cards: the README.md (Hugging Face metadata + what made the model) in every exported model folder,
and publishing a folder to the hub.

A step writes its card into `final/` before it commits, from what it receives (its config, summary, and the
manifests of its upstream steps, found through its inputs' lineage), so the card is committed with the weights
(a trace, infra/steps.py TRACES: no part of the ids downstream). Evaluation results that arrive later (lm-eval,
run after the step) go into the copy of the card `smolflow publish` uploads, never into the committed folder:
rewriting it would change the folder's files, checked against its manifest and listed in its results' key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from infra.errors import SmolflowError
from infra.steps import CARD, FINAL, HF_CONFIG, MANIFEST, TRL_ARGS, StepOutput, folder_step_id, identity, read_manifest, version
from infra.storage import verified_files
from infra.summaries import ChatDataSummary, PhaseSummary, Summary, TrainedSummary, read_summary
from postrain.data import sign_slips_note

LIMITS = (
    "Trained by smolflow as part of a pipeline run. A model of this size, trained on this little data, is a "
    "research and teaching artifact: it shows what each stage of the SmolLM3 recipe does, measured on the "
    "project's own held-out prompts and eval tasks. It has no safety tuning, knows little about the world, "
    "and should not be used to answer real questions or make decisions."
)


def _parameters(folder: Path) -> int:
    """Parameter count from the safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                n = 1
                for dim in f.get_slice(key).get_shape():
                    n *= dim
                total += n
    return total


def _size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _architecture(folder: Path) -> list[str]:
    c = json.loads((folder / HF_CONFIG).read_text())
    nope = [i for i, use in enumerate(c.get("no_rope_layers") or []) if not use]
    rows = [
        ("architecture", f"{c.get('architectures', ['?'])[0]} (`model_type: {c.get('model_type')}`)"),
        ("parameters", f"{_parameters(folder):,}"),
        ("layers / hidden / intermediate", f"{c['num_hidden_layers']} / {c['hidden_size']} / {c['intermediate_size']}"),
        ("attention heads (key-value heads)", f"{c['num_attention_heads']} ({c.get('num_key_value_heads')})"),
        ("vocabulary", f"{c['vocab_size']:,}"),
        ("context", f"{c.get('max_position_embeddings'):,} tokens"),
        ("RoPE", ", ".join(f"{k} {v}" for k, v in (c.get("rope_parameters") or {"rope_theta": c.get("rope_theta")}).items())),
        ("layers without RoPE (NoPE)", ", ".join(map(str, nope)) or "none"),
        ("tied embeddings", str(c.get("tie_word_embeddings"))),
    ]
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _history(steps: list[dict[str, Any]]) -> list[str]:
    """Pretraining phases (tokens, mixture) and post-training steps (trainer, held-out score) in training order, and any
    flaw planted in the chat data (a reader of the card must not take it for a defect of the pipeline)."""
    lines = []
    phases = [m for m in steps if isinstance(m["summary"], PhaseSummary)]
    if phases:
        lines += ["Pretraining:", "", "| phase | tokens | sequence length | mixture (share of sequences) | final loss |"]
        lines.append("|---|---|---|---|---|")
        for m in phases:
            t, s = m["config"]["train"], m["summary"]
            total = sum(t["samples"].values()) or 1
            mix = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(t["samples"].items()))
            loss = f"{s.final_loss:.3f}" if s.final_loss is not None else "n/a"
            lines.append(f"| {s.phase} | {s.tokens:,} | {s.seq_len} | {mix} | {loss} |")
        lines += ["", f"Tokens seen in pretraining: {sum(m['summary'].tokens for m in phases):,}.", ""]
    post = [m for m in steps if isinstance(m["summary"], TrainedSummary)]
    if post:
        lines += ["Post-training (held-out prompts, greedy):", ""]
        lines.append("| step | trainer settings | held-out accuracy | by family | answer tokens |")
        lines.append("|---|---|---|---|---|")
        for m in post:
            trainer = next((v for k, v in m["config"].items() if isinstance(v, dict) and "max_steps" in v), {})
            settings = ", ".join(f"{k} {trainer[k]}" for k in ("max_steps", "batch_size", "learning_rate") if k in trainer)
            e = m["summary"].eval
            family = ", ".join(f"{k} {v:.0%}" for k, v in e.by_family.items())
            lines.append(f"| {m['name']} | {settings} | {e.accuracy:.1%} | {family} | {e.mean_answer_tokens:.1f} |")
        lines.append("")
    slips = sum(m["summary"].sign_slips for m in steps if isinstance(m["summary"], ChatDataSummary))
    if slips:
        lines += [sign_slips_note(slips), ""]
    return lines


def _evals(records: Mapping[str, Any]) -> list[str]:
    if not records:
        return ["No lm-eval results were recorded for this folder when the card was written (`smolflow publish` adds them)."]
    lines = ["| task | metric | value | stderr |", "|---|---|---|---|"]
    for task, r in sorted(records.items()):
        for metric, value in sorted(r["metrics"].items()):
            if "stderr" in metric or metric == "chance" or not isinstance(value, int | float):
                continue
            stderr = r["metrics"].get(metric.replace("/", "_stderr/") if "/" in metric else f"{metric}_stderr")
            lines.append(f"| {task} | {metric} | {value:.4f} | {'' if stderr is None else f'{stderr:.4f}'} |")
    return lines


def render(folder: Path, name: str, step_id: str, run_dir: Path, steps: list[dict[str, Any]], evals: Mapping[str, Any]) -> str:
    """The card of model FOLDER, made by step NAME (STEP_ID) of RUN_DIR; STEPS: the manifests of its lineage and
    its own (name, step_id, config, summary), upstream first, summaries typed (`typed`); EVALS: lm-eval results by task."""
    recipe = run_dir / "recipe.json"
    recipe_name = json.loads(recipe.read_text()).get("name", "?") if recipe.is_file() else "?"
    recipe_hash = hashlib.sha256(recipe.read_bytes()).hexdigest()[:12] if recipe.is_file() else "?"
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation", "license: apache-2.0", "language:", "- en", "tags:"]
    front += ["- smolflow", "- smollm3", f"- {name}", "---", ""]
    lines = front + [
        f"# {recipe_name} / {name}",
        "",
        f"A SmolLM3-architecture model from step `{name}` (step id `{step_id}`) of a smolflow run of the recipe `{recipe_name}`.",
        "",
        "## Model",
        "",
        *_architecture(folder),
        "",
        "## Training",
        "",
        *_history(steps),
        "## Evaluation",
        "",
        *_evals(evals),
        "",
        "## Lineage",
        "",
        f"Recipe `{recipe_name}` (`recipe.json` of the run, sha256 `{recipe_hash}`). Every step that led to this model, "
        "from curation on; a step's id hashes its config and its inputs' fingerprints (rerun the recipe to rebuild it):",
        "",
        "| step | step id |",
        "|---|---|",
        *[f"| {m['name']} | `{m['step_id']}` |" for m in steps],
        "",
        "## Use",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        'chat = pipeline("text-generation", model="PATH_OR_REPO_ID")',
        'print(chat([{"role": "user", "content": "What is 12 + 7?"}], max_new_tokens=32, clean_up_tokenization_spaces=False))',
        "```",
        "",
        "## Intended use and limits",
        "",
        LIMITS,
        "",
        "## Publish",
        "",
        "```bash",
        f"smolflow publish RUN_DIR {name} REPO_ID   # needs the network and a token (HF_TOKEN or `hf auth login`)",
        "```",
        "",
    ]
    return "\n".join(lines)


def lineage_manifests(inputs: Mapping[str, StepOutput]) -> list[dict[str, Any]]:
    """The manifests of every upstream step of these inputs, upstream first (each from the input's run dir)."""
    out: dict[str, dict[str, Any]] = {}
    for upstream in inputs.values():
        for name, sid in (upstream.lineage | {upstream.name: upstream.step_id}).items():
            folder = version(upstream.path.parent, name, sid)
            if manifest := read_manifest(folder):
                out.setdefault(name, typed(manifest, folder))
    return list(out.values())


def typed(manifest: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A manifest with its summary read as the model it was written with."""
    return manifest | {"summary": read_summary(manifest.get("summary", {}), manifest.get("summary_schema"), str(folder / MANIFEST))}


def write_card(out: Path, config: BaseModel, summary: Summary, inputs: Mapping[str, StepOutput]) -> Path:
    """Inside a build: write `out/final/README.md` for the model the step leaves there."""
    sid = folder_step_id(out)
    name = out.name.removesuffix(f"-{sid}")  # a store folder is NAME-ID
    own = {"name": name, "step_id": sid, "config": identity(config), "summary": summary}
    run_dir = next(iter(inputs.values())).path.parent if inputs else out.parent.parent.parent  # RUN/NAME, else RUN/steps/.partial/NAME-ID
    path = out / FINAL / CARD
    path.write_text(render(out / FINAL, name, sid, run_dir, [*lineage_manifests(inputs), own], {}))
    return path


def publish_card(run_dir: Path, name: str, steps: Iterable[str]) -> tuple[Path, list[Path], str]:
    """Finished step NAME's model folder, its files checked against its manifest, and its card with the lm-eval
    results recorded since (for `smolflow publish`). STEPS: the run's graph; NAME must be one of them, and its
    folder the version the run's store holds (no `..`, no other run's step, no link out of it)."""
    from tasks.evaluation.results import local_fingerprint, run_results

    if name not in (steps := list(steps)):
        raise SmolflowError(f"{name!r} is not a step of the run at {run_dir}; its steps: {', '.join(steps)}")
    step = run_dir / name
    manifest = read_manifest(step)
    if manifest is None or not (step / FINAL / HF_CONFIG).is_file():
        found = sorted(p.parent.parent.name for p in run_dir.glob(f"*/{FINAL}/{HF_CONFIG}") if read_manifest(p.parent.parent))
        raise SmolflowError(f"{step}: no finished model folder (final/ of a finished step); finished here: {', '.join(found) or 'none'}")
    home = version(run_dir, name, manifest["step_id"])
    if step.resolve() != home.resolve():
        raise SmolflowError(f"{step} leads to {step.resolve()}, not to its version in the run's store ({home})")
    folder = home / FINAL
    files = verified_files(folder, manifest.get("files", {}), f"{FINAL}/")
    record = run_results(run_dir).get(local_fingerprint(folder)) or {}
    folders = [version(run_dir, n, sid) for n, sid in manifest.get("lineage", [])]
    lineage = [typed(m, folder) for folder in folders if (m := read_manifest(folder))]
    return folder, files, render(folder, name, manifest["step_id"], run_dir, [*lineage, typed(manifest, step)], record.get("tasks", {}))


def publish(folder: Path, files: list[Path], card: str, repo_id: str, private: bool) -> str:
    """Upload FILES of FOLDER (publish_card's, checked) with CARD as its README.md to the hub in one commit; the URL of the commit."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise SmolflowError(
            "publishing needs the Hugging Face hub, and HF_HUB_OFFLINE is set (smolflow sets it by default for offline "
            "machines): run `HF_HUB_OFFLINE=0 smolflow publish ...` on a machine with network access"
        )
    if not (get_token() or os.environ.get("HF_TOKEN")):
        raise SmolflowError("no Hugging Face token: set HF_TOKEN or run `hf auth login`, then publish again")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
    except OSError as err:  # requests' ConnectionError is an OSError
        raise SmolflowError(f"cannot reach the hub at {constants.ENDPOINT} to create {repo_id}: {type(err).__name__}") from None
    # TRL's pickled training arguments stay local: a pickle is code to whoever loads it
    ops = [
        CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
        for p in files
        if p.name not in (CARD, TRL_ARGS)
    ]
    ops.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))
    info = api.create_commit(repo_id, ops, commit_message=f"smolflow: {folder.parent.name}")
    return info.commit_url
