"""Ablations: a base recipe and variants that differ in a few keys, each run with one or more seeds.

An ablation file is small YAML:

    name: apo_vs_dpo
    base: ../tiny.yaml            # relative to this file
    set: []                       # overrides every variant shares (a proxy scale-down)
    until: apo                    # the last stage the variants need (then evaluate)
    seeds: 3                      # runs per variant, `seed_key` = its value + 0, 1, 2
    seed_key: auto                # the default: the seeds of the trained steps the variants build apart
    variants:
      - {name: apo, set: ["postrain.apo.loss_type=[apo_zero, sft]"]}
      - {name: dpo, set: ["postrain.apo.loss_type=[sigmoid, sft]"]}

Every run's recipe is resolved and validated here, before anything runs, so a bad override names
the variant and the key. Variants may not change `evaluation`: one evaluation compares them all.
`seed_key: auto` needs the step graph, so flows/ablation.py names its keys before the runs resolve.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, ValidationError, model_validator

from infra.recipe import Recipe, RecipeError, Strict, format_validation_error, load_recipe, operational, read_yaml, recipe_dump

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
AUTO = "auto"
M = TypeVar("M", bound=Strict)


class VariantCfg(Strict):
    name: str = Field(pattern=NAME)
    set: list[str] = []


class AblationCfg(Strict):
    name: str = Field(pattern=NAME)
    base: str = Field(description="the base recipe, relative to the ablation file")
    description: str = ""
    set: list[str] = Field([], description="overrides all variants share, applied before each variant's own")
    variants: list[VariantCfg] = Field(min_length=1, description="two or more; one alone with `seeds` >= 2 (a seed study)")
    baseline: str | None = Field(None, description="the variant the others are compared with; default: the first")
    seeds: int = Field(1, ge=1, le=20)
    seed_key: str | list[str] = Field(
        AUTO,
        description="the integer recipe key the seeds vary, or a list of them, varied together (each its own value + k); "
        "auto: the seeds of the trained steps the variants build apart (a seed study: every step it trains), so a seed "
        "repeats what is compared on the same curation, where `seed` rebuilds the corpus too",
    )
    until: str | None = Field(None, description="the last stage the variants run (evaluation follows); default: all")
    concurrency: int = operational(1, ge=1, description="runs at once (they share the machine's cores)")
    run_dir: str | None = Field(None, description="default: runs/ablations/NAME")

    @model_validator(mode="after")
    def _variants(self) -> AblationCfg:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names repeat: {names}")
        if len(names) == 1 and self.seeds < 2:
            raise ValueError("one variant compares nothing: add a variant, or `seeds: 2` or more for a seed study")
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not a variant ({', '.join(names)})")
        return self

    @property
    def seed_keys(self) -> list[str]:
        """The keys the seeds vary; auto with one seed varies none (a swarm's proxies), else it is named first."""
        if self.seed_key == AUTO:
            if self.seeds == 1:
                return []
            raise ValueError("seed_key auto is named from the step graph (flows/ablation.py: varied_seeds) first")
        return [self.seed_key] if isinstance(self.seed_key, str) else self.seed_key


@dataclass(frozen=True)
class AblationRun:
    """One run of an ablation: a variant with one seed, its own run dir and fully resolved recipe."""

    name: str  # the run dir's name: the variant, or VARIANT-seedK
    variant: str
    seed: int | None  # the value of (the first) seed_key; None where none applies (auto with one seed: a swarm's proxies)
    overrides: tuple[str, ...]  # applied to the base recipe, in order
    recipe: Recipe


@dataclass(frozen=True)
class Ablation:
    cfg: AblationCfg
    path: Path  # the ablation file
    base: Path  # the base recipe
    root: Path  # the ablation's folder: one run dir per run, the shared step store, the report
    runs: list[AblationRun]

    @property
    def baseline(self) -> str:
        return self.cfg.baseline or self.cfg.variants[0].name


def read_spec(path: Path, model: type[M], kind: str) -> M:
    """An ablation or swarm file, validated by MODEL; errors name the file and the key."""
    data = read_yaml(path, kind)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: {kind} files are YAML mappings, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, str(path), kind)) from None


def shared_recipe(path: Path, base: str, overrides: list[str]) -> tuple[Path, Recipe]:
    """The base recipe (BASE relative to the file at PATH) with the overrides every run shares."""
    resolved = (path.parent / base).resolve()
    try:
        return resolved, load_recipe(resolved, overrides)
    except RecipeError as err:
        raise RecipeError(f"{path}: base recipe with the shared overrides (`set`): {err}") from None


def resolve_ablation(cfg: AblationCfg, path: Path, root: Path) -> Ablation:
    """Every run's recipe: the base (relative to PATH) with the shared, then the variant's, then the seed's overrides."""
    base, shared = shared_recipe(path, cfg.base, cfg.set)
    firsts = [_seed_value(shared, key, path) for key in cfg.seed_keys]
    if cfg.seeds > 1 and not firsts:
        raise RecipeError(f"{path}: seeds: {cfg.seeds} with an empty seed_key: the runs would be the same")
    runs = []
    for variant in cfg.variants:
        for assignment in variant.set:
            if assignment.partition("=")[0].split(".")[0] == "evaluation":
                raise RecipeError(
                    f"{path}: variant {variant.name}: {assignment.partition('=')[0]}: variants share one evaluation "
                    "(put evaluation changes in the ablation's `set`)"
                )
        for k in range(cfg.seeds):
            seeds = [f"{key}={first + k}" for key, first in zip(cfg.seed_keys, firsts)] if cfg.seeds > 1 else []
            overrides = (*cfg.set, *variant.set, *seeds)
            try:
                recipe = load_recipe(base, list(overrides))
            except RecipeError as err:
                raise RecipeError(f"{path}: variant {variant.name}: {err}") from None
            name = variant.name if cfg.seeds == 1 else f"{variant.name}-seed{k}"
            runs.append(AblationRun(name, variant.name, firsts[0] + k if firsts else None, overrides, recipe))
    return Ablation(cfg, path, base, root, runs)


def _seed_value(recipe: Recipe, key: str, path: Path) -> int:
    """The value of `key` in the recipe (an unset per-step seed falls back to the recipe's seed)."""
    node: Any = recipe_dump(recipe)
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise RecipeError(f"{path}: seed_key {key}: the recipe has no such key")
    if node is None:
        return recipe.seed
    if not isinstance(node, int) or isinstance(node, bool):
        raise RecipeError(f"{path}: seed_key {key}: not an integer key (its value is {node!r})")
    return node
