"""Swarms: many small proxy runs whose only difference is one phase's mixture, to fit mixture -> loss.

A swarm file is small YAML:

    name: mix_phase1
    base: ../tiny.yaml          # relative to this file
    set: [...]                  # the proxy scale-down every proxy shares (as an ablation's `set`)
    phase: 0                    # the pretraining phase whose mixture is searched
    proxies: 8
    seed: 0                     # of the mixture draws (the proxies train with the recipe's seed)
    concentration: 8            # Dirichlet(concentration x prior): larger stays closer to the prior
    sparsity: 0.3               # chance a draw leaves a source out (weight 0): such proxies survive a change of it
    prior: null                 # default: the base recipe's mixture of that phase; or a swarm's report/swarm.json: its proposal
    frozen: []                  # sources that keep the prior's proportions among them and move as one
    bounds: {math: [0.05, 0.6]} # per source, [low, high]
    targets: {smol_ppl_prose: 1, smol_ppl_code: 1, smol_ppl_math: 1}   # task -> weight of its main metric
    later_phases: false         # a proxy ends at the searched phase (pretrain.until_phase); true: it trains them all
    concurrency: 2

The mixtures are drawn here, from a seeded generator, so a rerun draws the same proxies and every
proxy is a step identity the store already knows. A draw outside the bounds, or one the caller's
`admissible` check refuses (the repetition cap, which needs the curated token counts), is redrawn
and counted.

`frozen` is Olmix's mixture reuse: after one source's data changed (or a source was added), search it
against the others as the last proposal mixed them. The frozen sources move as one group, so the draws
and the fits vary fewer weights and fewer proxies suffice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import Field, model_validator

from infra.ablation import NAME, AblationCfg, VariantCfg, read_spec, shared_recipe
from infra.recipe import Recipe, RecipeError, Strict, operational

MAX_DRAWS = 10_000  # per proxy: bounds and the cap that leave no room fail instead of looping
PROPOSAL = "proposal"  # the key of a swarm report's (`report/swarm.json`) proposed mixture


class ValidationCfg(Strict):
    """The proposal checked where it matters: trained beside the prior and the natural mixture at a larger scale."""

    scale: int = Field(4, ge=2, description="x the proxies' tokens, every phase")
    seeds: int = Field(2, ge=2, le=20, description="runs per mixture (pretrain.seed varies: initial weights and batch order)")


class SwarmCfg(Strict):
    name: str = Field(pattern=NAME)
    base: str = Field(description="the base recipe, relative to the swarm file")
    description: str = ""
    set: list[str] = Field([], description="overrides every proxy shares: the proxy scale-down")
    phase: int = Field(0, ge=0, description="index of the pretraining phase whose mixture is searched")
    proxies: int = Field(8, ge=4, le=512)
    seed: int = 0
    concentration: float = Field(8.0, gt=0, description="Dirichlet concentration: alpha = concentration x prior")
    sparsity: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="chance a draw leaves out each source whose lower bound is 0 (RegMix's sparse draws): a proxy that "
        "leaves a source out does not read its data, so when that data changes the proxy is reused as it is",
    )
    prior: dict[str, float] | str | None = Field(
        None,
        description="default: the base recipe's mixture of the phase; a path (from the current directory, like run_dir) to "
        "another swarm's report/swarm.json takes its proposal (a source added since: the recipe's weight)",
    )
    frozen: list[str] = Field(
        [],
        description="sources that keep the prior's proportions among them and move as one weight (Olmix's mixture reuse): "
        "after one source's data changed, search it against the rest as the last proposal mixed them, with fewer proxies",
    )
    bounds: dict[str, tuple[float, float]] = Field({}, description="per source: [low, high] of its weight")
    targets: dict[str, float] = Field(min_length=1, description="task -> weight of its main metric in the target (lower is better)")
    later_phases: bool = Field(
        False,
        description="train the phases after the searched one too and score the final model; by default a proxy ends at "
        "the searched phase (`pretrain.until_phase`): cheaper, and its learning rate decays on the mixture searched",
    )
    validation: ValidationCfg | None = Field(ValidationCfg(), description="null: propose without training the proposal at a larger scale")
    concurrency: int = operational(1, ge=1, description="proxies trained at once (they share the machine's cores)")
    run_dir: str | None = Field(None, description="default: runs/swarms/NAME")

    @model_validator(mode="after")
    def _checks(self) -> SwarmCfg:
        for source, (low, high) in self.bounds.items():
            if not 0 <= low < high <= 1:
                raise ValueError(f"bounds.{source}: [{low}, {high}] is not 0 <= low < high <= 1")
        if any(w <= 0 for w in self.targets.values()):
            raise ValueError("targets: every weight must be > 0")
        if self.frozen and (len(self.frozen) < 2 or len(set(self.frozen)) < len(self.frozen)):
            raise ValueError(f"frozen: {self.frozen}: name two sources or more, each once (one source alone moves freely anyway)")
        return self


@dataclass(frozen=True)
class Groups:
    """The weights a swarm varies: each source alone, but the frozen sources as one group in fixed proportions.
    `of` maps mixtures of sources to the groups' weights, `expand` maps back; both are identities without `frozen`."""

    sources: list[str]
    names: list[str]  # a free source's name, or the frozen sources' joined with '+'
    to_groups: np.ndarray  # (sources, groups): 1 where a source belongs to a group
    proportions: np.ndarray  # (groups, sources): each group's sources as shares of its weight

    def of(self, w: np.ndarray) -> np.ndarray:
        return w @ self.to_groups

    def expand(self, v: np.ndarray) -> np.ndarray:
        return v @ self.proportions

    @property
    def frozen(self) -> dict[str, dict[str, float]]:
        """The frozen group (none, or one), as its sources' shares of its weight."""
        return {
            name: {s: round(float(x), 6) for s, x in zip(self.sources, share, strict=True) if x > 0}
            for name, share, members in zip(self.names, self.proportions, self.to_groups.sum(axis=0), strict=True)
            if members > 1
        }


def grouping(sources: list[str], prior: np.ndarray, frozen: list[str] = ()) -> Groups:
    """The frozen sources (if any) as one group, in the prior's proportions and where the first of them stands; the others alone."""
    together = [s for s in sources if s in frozen]
    blocks = [together if s in frozen else [s] for s in sources if s not in frozen or s == together[0]]
    to = np.array([[s in block for block in blocks] for s in sources], dtype=float)
    share = to.T * prior
    return Groups(sources, ["+".join(b) for b in blocks], to, share / share.sum(axis=1, keepdims=True))


@dataclass(frozen=True)
class Swarm:
    cfg: SwarmCfg
    path: Path
    base: Path
    root: Path
    recipe: Recipe  # the base with the shared overrides
    sources: list[str]  # the searched phase's sources, in recipe order
    prior: np.ndarray
    groups: Groups  # the weights the draws and the fits vary (`frozen` sources as one)

    def ablation_cfg(self, mixtures: np.ndarray) -> AblationCfg:
        """The proxies as an ablation's variants: each sets the searched phase's mixture and nothing else."""
        variants = [VariantCfg(name=proxy_name(i), set=[self.mixture_override(w)]) for i, w in enumerate(mixtures)]
        return AblationCfg(
            name=self.cfg.name,
            base=self.cfg.base,
            description=self.cfg.description,
            set=self.cfg.set,
            variants=variants,
            until="pretrain",
            concurrency=self.cfg.concurrency,
        )

    def mixture(self, weights: np.ndarray) -> dict[str, float]:
        """The phase's mixture as a recipe holds it: a source left out (weight 0) is not in it."""
        return {s: w for s, w in self.as_dict(weights).items() if w > 0}

    def mixture_override(self, weights: np.ndarray) -> str:
        pairs = ", ".join(f"{s}: {w:g}" for s, w in self.mixture(weights).items())
        return f"pretrain.phases.{self.cfg.phase}.mixture={{{pairs}}}"

    def as_dict(self, weights: np.ndarray) -> dict[str, float]:
        return {s: round(float(w), 6) for s, w in zip(self.sources, weights, strict=True)}


def proxy_name(i: int) -> str:
    return f"p{i:03d}"


def load_swarm(path: str | Path, run_dir: str | None = None, overrides: list[str] | None = None) -> Swarm:
    """Read and validate a swarm file against its base recipe; errors name the file and the key. OVERRIDES
    (e.g. `@configs/overlays/slurm.yaml`: where proxies train) follow the file's own `set`."""
    path = Path(path)
    cfg = read_spec(path, SwarmCfg, "swarm")
    cfg = cfg.model_copy(update={"set": [*cfg.set, *(overrides or [])]})
    base, recipe = shared_recipe(path, cfg.base, cfg.set)
    phases = recipe.pretrain.phases
    if cfg.phase >= len(phases):
        raise RecipeError(f"{path}: phase: {cfg.phase} is not a phase index of {base.name} (it has {len(phases)})")
    if not cfg.later_phases:  # every proxy, the curation run and the validation share this recipe
        cfg = cfg.model_copy(update={"set": [*cfg.set, f"pretrain.until_phase={phases[cfg.phase].name}"]})
        base, recipe = shared_recipe(path, cfg.base, cfg.set)
        phases = recipe.pretrain.phases
    mixture = phases[cfg.phase].mixture
    sources = list(mixture)
    if unknown := sorted(set(cfg.bounds) - set(sources)):
        raise RecipeError(f"{path}: bounds.{unknown[0]}: not a source of phase {phases[cfg.phase].name} ({', '.join(sources)})")
    for source in cfg.frozen:
        if source not in sources:
            raise RecipeError(f"{path}: frozen: {source}: not a source of phase {phases[cfg.phase].name} ({', '.join(sources)})")
    if len(cfg.frozen) >= len(sources):
        raise RecipeError(f"{path}: frozen: every source of phase {phases[cfg.phase].name}: leave one or more free to search")
    evaluated = set(recipe.evaluation.checkpoint_tasks)
    if missing := sorted(set(cfg.targets) - evaluated):
        known = ", ".join(sorted(evaluated))
        raise RecipeError(f"{path}: targets.{missing[0]}: not among the recipe's evaluation.checkpoint_tasks ({known})")
    given = proposed(path, Path(cfg.prior), mixture) if isinstance(cfg.prior, str) else cfg.prior
    if unknown := sorted(set(given or {}) - set(sources)):
        raise RecipeError(f"{path}: prior.{unknown[0]}: not a source of phase {phases[cfg.phase].name} ({', '.join(sources)})")
    prior = np.array([(given or mixture).get(s, 0.0) for s in sources], dtype=float)
    if (prior <= 0).any():
        raise RecipeError(f"{path}: prior: every source of the phase needs a weight > 0 (a Dirichlet parameter)")
    prior = rounded(prior / prior.sum())  # written into p000's recipe: weights it accepts
    low, high = bounds_of(cfg, sources)
    if low.sum() > 1 or high.sum() < 1:
        raise RecipeError(f"{path}: bounds: no mixture fits them (lows sum to {low.sum():g}, highs to {high.sum():g})")
    root = Path(run_dir or cfg.run_dir or Path("runs") / "swarms" / cfg.name)
    return Swarm(cfg, path, base, root, recipe, sources, prior, grouping(sources, prior, cfg.frozen))


def proposed(path: Path, report: Path, mixture: dict[str, float]) -> dict[str, float]:
    """The mixture another swarm's report proposed, as the prior of a swarm that goes on from it over the phase's MIXTURE
    (Olmix's updates): a source removed since drops out (the rest renormalize); a source added since takes the recipe's
    weight, and the proposal the rest."""
    try:
        before = json.loads(report.read_text())[PROPOSAL]["mixture"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecipeError(f"{path}: prior: {report}: not a swarm report with a proposal (run that swarm first): {e}") from e
    if not (prior := carried(before, mixture)):
        raise RecipeError(f"{path}: prior: {report}: its proposal shares no source with the phase ({', '.join(mixture)})")
    return prior


def carried(before: dict[str, float], mixture: dict[str, float]) -> dict[str, float] | None:
    """A mixture proposed BEFORE, over the phase's sources as its MIXTURE has them now (Olmix's updates): a source removed
    since drops out (the rest renormalize); a source added since takes the recipe's weight, and the proposal the rest.
    None when they share no source."""
    if not (kept := {s: w for s, w in before.items() if s in mixture}):
        return None
    added = {s: w for s, w in mixture.items() if s not in before}
    return {s: w / sum(kept.values()) * (1 - sum(added.values())) for s, w in kept.items()} | added


def bounds_of(cfg: SwarmCfg, sources: list[str]) -> tuple[np.ndarray, np.ndarray]:
    low = np.array([cfg.bounds.get(s, (0.0, 1.0))[0] for s in sources])
    high = np.array([cfg.bounds.get(s, (0.0, 1.0))[1] for s in sources])
    return low, high


@dataclass(frozen=True)
class Draws:
    mixtures: np.ndarray  # (n, sources), each row sums to 1
    redrawn: dict[str, int]  # why draws were refused -> how many


def draw_mixtures(swarm: Swarm, n: int, seed: int, admissible: Callable[[np.ndarray], str | None] = lambda w: None) -> Draws:
    """`n` mixtures from Dirichlet(concentration x prior), RegMix-style, each within the bounds and passing
    `admissible` (None, or why not); refused draws are redrawn and counted by reason. The prior
    itself comes first when it is admissible: the swarm's anchor, the mixture a hand-set recipe would use."""
    rng = np.random.default_rng(seed)
    low, high = bounds_of(swarm.cfg, swarm.sources)
    groups = swarm.groups
    alpha = swarm.cfg.concentration * groups.of(swarm.prior)
    chosen: list[np.ndarray] = []
    redrawn: dict[str, int] = {}

    def refuse(w: np.ndarray) -> str | None:
        if (w < low - 1e-12).any() or (w > high + 1e-12).any():
            return "outside the bounds"
        return admissible(w)

    droppable = groups.of(low) == 0

    def draw() -> np.ndarray:
        v = rng.dirichlet(alpha)
        if swarm.cfg.sparsity == 0:
            return groups.expand(v)  # no extra random numbers: a seed's dense draws stay as they were
        kept = ~droppable | (rng.random(len(v)) >= swarm.cfg.sparsity)
        return groups.expand(v * kept / (v * kept).sum() if kept.any() else v)

    candidates = [swarm.prior]
    while len(chosen) < n:
        w = rounded(candidates.pop() if candidates else draw())
        if (why := refuse(w)) is None:
            chosen.append(w)
            continue
        redrawn[why] = redrawn.get(why, 0) + 1
        if sum(redrawn.values()) > MAX_DRAWS * n:
            raise RecipeError(
                f"{swarm.path}: {len(chosen)} of {n} mixtures after {sum(redrawn.values())} draws ({redrawn}): widen the bounds, "
                "lower the phases' tokens or raise pretrain.max_epochs"
            )
    return Draws(np.array(chosen), redrawn)


def rounded(w: np.ndarray, places: int = 4) -> np.ndarray:
    """Weights a recipe accepts as written: each left in > 0 at PLACES decimals (a 0 stays out), summing to 1 (the
    largest takes the rest)."""
    w = np.where(w > 0, np.maximum(np.round(w, places), 10.0**-places), 0.0)
    w[np.argmax(w)] += 1 - w.sum()
    return np.round(w, places)
