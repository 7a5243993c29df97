"""Recipes: one YAML file is the whole experiment, validated by typed pydantic models.

Every model forbids unknown keys, so a misspelt key fails at load time with its dotted path and
the file name instead of being silently ignored halfway through a run.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, WithJsonSchema, model_validator

from infra.errors import SmolflowError


class RecipeError(SmolflowError, ValueError):
    """A recipe that cannot be used as written; the message names the file and the key."""


RAY_ADDRESS = r"^[A-Za-z0-9_.:/\[\]-]+$"  # host:port or ray://...: nothing a shell or URL could read otherwise


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def operational(default: Any = ..., **kwargs: Any) -> Any:
    """A field that changes how a step runs, never what it produces (threads, cadence, layout, endpoints).

    It is marked here, once, and left out of every step's identity (infra/steps.py `identity`), so
    editing it reruns nothing; every other field a step's config holds is part of its identity.
    """
    return Field(default, json_schema_extra={"operational": True}, **kwargs)


def is_operational(field) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("operational"))


_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(value: Any) -> Any:
    """Accept token counts written as `20M`, `1.5B`, `11T` as well as plain integers."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBGT]?)\s*", value, flags=re.IGNORECASE)
        if not match:
            raise ValueError(f"expected a count such as 20M or 1.5B, got {value!r}")
        return int(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])
    return value


Count = Annotated[int, BeforeValidator(parse_count), Field(gt=0)]


def per_job(value: Any) -> Any:
    """One message for a bad `tasks_per_job`, not one per member of its union."""
    if value == "even" or (type(value) is int and value > 0):
        return value
    raise ValueError(f"expected a positive integer or 'even', got {value!r}")


PerJob = Annotated[int | Literal["even"], BeforeValidator(per_job)]
Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]


# Slurm values end up in batch scripts and sbatch command lines: no spaces, newlines or shell metacharacters
SlurmWord = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.,:=/@%+-]+$")]
SlurmTime = Annotated[str, Field(pattern=r"^(\d+-)?\d+(:\d{2}){0,2}$", description="minutes, MM:SS, HH:MM:SS or D-HH:MM:SS")]
# extra sbatch options, from this list only: `export`, `chdir`, `output`, `wrap` or `uid` would change what the job runs or where
SBATCH_KEYS = ("account", "qos", "constraint", "exclusive", "mem", "mem-per-cpu", "mem-per-gpu", "gres", "gpus", "gpus-per-task",
               "cpus-per-gpu", "reservation", "nodelist", "exclude", "comment", "mail-type", "mail-user", "hint", "wckey",
               "licenses", "switches", "network")  # fmt: skip
SbatchArgs = dict[Literal[SBATCH_KEYS], Annotated[str, Field(pattern=r"^[A-Za-z0-9_.,:=/@%+-]*$")]]


class SlurmCfg(Strict):
    """Where datatrove's Slurm executor submits; where a job runs does not change what it produces."""

    partition: SlurmWord = "cpu"
    time: SlurmTime = "24:00:00"
    cpus_per_task: int = Field(1, gt=0)
    mem_per_cpu_gb: float = Field(2, gt=0)
    sbatch_args: SbatchArgs = {}


class ExecutorCfg(Strict):
    """How datatrove runs a pipeline: locally, or scaled out on Slurm or Ray."""

    kind: Literal["local", "slurm", "ray"] = operational("local")
    tasks: int = Field(2, gt=0, description="shards a pipeline is split into (shard files and token order depend on it)")
    workers: int = operational(2, gt=0, description="shards run at once (local executor)")
    tasks_per_job: PerJob = operational(
        1,
        description="shards one Slurm array job (in turn) or Ray actor (at once, a process each) runs (datatrove's "
        "tasks_per_job); 'even': ceil(shards / workers), so a pipeline starts at most `workers` jobs, for shards shorter "
        "than a job's start",
    )
    slurm: SlurmCfg = operational(SlurmCfg())
    timeout_hours: float = operational(48, gt=0, description="a cluster pipeline still incomplete after this long fails its task")
    ray_address: str | None = operational(
        None, pattern=RAY_ADDRESS, description="the Ray cluster (host:port, ray://...); default: the one started here"
    )


class S3Cfg(Strict):
    """Where s3:// paths live; credentials fall back to the standard AWS_* environment variables.

    All operational: the same objects read through another endpoint or key are the same data, and
    what a source holds enters a step's identity through its content fingerprint.
    """

    endpoint_url: str | None = operational(None)
    region: str | None = operational(None)
    key: SecretStr | None = operational(None)
    secret: SecretStr | None = operational(None)
    part_size: int = operational(50 * 2**20, ge=5 * 2**20, description="bytes per part of a multipart upload (S3's minimum: 5 MiB)")

    def storage_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.key is not None:
            options["key"] = self.key.get_secret_value()
        if self.secret is not None:
            options["secret"] = self.secret.get_secret_value()
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        if client:
            options["client_kwargs"] = client
        return options


class StorageCfg(Strict):
    s3: S3Cfg = operational(S3Cfg())
    mirror: str | None = operational(None, description="s3:// prefix every finished step is mirrored to")
    store: str | None = operational(
        None, description="step store shared with other runs and ablations (e.g. runs/steps); default: the run's own RUN/steps"
    )
    wait_for_builder_s: float = operational(
        86400.0, gt=0, description="how long a run waits for another process building the same step before it gives up"
    )

    @model_validator(mode="after")
    def _mirror_is_s3(self) -> StorageCfg:
        if self.mirror is not None and not self.mirror.startswith("s3://"):
            raise ValueError(f"mirror must be an s3:// prefix, got {self.mirror!r}")
        return self


class SourceCfg(Strict):
    """One raw data source. `path` is a local folder or file, an s3:// prefix or hf://datasets/..."""

    name: Name
    domain: Name
    format: Literal["embedded", "jsonl", "parquet", "text"]
    path: str | None = None
    glob: str | None = Field(None, description="file pattern inside `path`, e.g. '*.jsonl.gz'")
    text_key: str = "text"
    id_key: str = "id"
    limit: int | None = Field(None, gt=0, description="read at most this many documents")

    @model_validator(mode="after")
    def _path_matches_format(self) -> SourceCfg:
        if self.format == "embedded":
            if self.path is not None:
                raise ValueError("an embedded source is built by the project and takes no path")
            if self.domain not in ("prose", "code", "math"):
                raise ValueError(f"an embedded source's domain is prose, code or math, not {self.domain!r}")
        elif not self.path:
            raise ValueError(f"a {self.format} source needs a path (local folder, s3:// or hf://datasets/...)")
        return self


class EmbeddedCorpusCfg(Strict):
    """Sizes of the corpus built from the stdlib and generated math (see tasks/curation/corpus.py)."""

    stdlib_max_mb: float | None = Field(None, gt=0, description="cap on stdlib source read; null = all")
    math_problems: int = Field(60_000, ge=0)
    problems_per_doc: int = Field(12, gt=0)
    max_value: int = Field(99, gt=0, description="largest operand in generated problems")


# The filters a recipe may name, with the keys that point at a downloaded asset (a local path or
# s3:// URL: they cannot be fetched offline). Which datatrove class each is, and which parameters
# it takes, is the curation code's business (tasks/curation/filters.py checks them).
FILTER_ASSETS: dict[str, tuple[str, ...]] = {
    "gopher_quality": (),
    "gopher_repetition": (),
    "c4_quality": (),
    "fineweb_quality": (),
    "language": ("model_path",),
    "c4_badwords": ("badwords_path",),
    "unigram_logprob": ("frequencies_path",),
    "fasttext_classifier": ("model_url",),
    "code_quality": (),
    "length": (),
}


def _check_filter(name: str, params: dict[str, Any]) -> None:
    if name not in FILTER_ASSETS:
        raise ValueError(f"unknown filter {name!r}; known filters: {', '.join(sorted(FILTER_ASSETS))}")
    for asset in FILTER_ASSETS[name]:
        if not params.get(asset):
            raise ValueError(
                f"filter {name!r} needs a downloaded asset: set {asset} to a local path or s3:// URL "
                "(it cannot be fetched offline), or remove the filter"
            )


class MinhashCfg(Strict):
    enabled: bool = True
    n_grams: int = Field(5, gt=0)
    buckets: int = Field(14, gt=0)
    hashes_per_bucket: int = Field(8, gt=0)
    normalize_numbers: bool = Field(
        False,
        description="map every number to 0 before hashing (datatrove's default); makes templated math "
        "worksheets look like copies of each other",
    )


class DedupCfg(Strict):
    exact: bool = True
    minhash: MinhashCfg = MinhashCfg()


class DecontaminateCfg(Strict):
    """Remove training documents that contain n-grams of the eval sets' items."""

    enabled: bool = True
    eval_sets: list[str] = []
    fields: list[str] = Field(["question", "answer"], description="JSONL fields whose text is indexed")
    n_grams: int = Field(10, gt=1)


class TokenizerTrainCfg(Strict):
    vocab_size: int = Field(4096, ge=300)
    min_frequency: int = Field(2, ge=1)
    sample_mb: float = Field(32, gt=0, description="curated text the BPE is trained on")


class TokenizerCfg(Strict):
    """Either train a byte-level BPE on the curated text, or name an existing tokenizer.json."""

    train: TokenizerTrainCfg | None = None
    path: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> TokenizerCfg:
        if (self.train is None) == (self.path is None):
            raise ValueError("give exactly one of `train` (train a BPE) or `path` (an existing tokenizer.json)")
        if self.path is not None and not self.path.endswith("tokenizer.json"):
            raise ValueError("path must point at tokenizer.json itself (a folder is read as a hub repo id)")
        return self


class CurateCfg(Strict):
    strict: bool = operational(False, description="fail on a malformed record instead of skipping and counting it")
    filters: dict[Name, dict[str, dict[str, Any]]] = Field(
        default_factory=dict, description="domain -> filter name -> datatrove parameters"
    )
    dedup: DedupCfg = DedupCfg()
    decontaminate: DecontaminateCfg = DecontaminateCfg()
    tokenizer: TokenizerCfg
    heldout_fraction: float = Field(0.01, ge=0, lt=0.5, description="documents per source kept out of training for perplexity evals")
    examples_per_filter: int = operational(3, ge=0, description="removed documents shown in the report")

    @model_validator(mode="after")
    def _filters_known(self) -> CurateCfg:
        for domain, filters in self.filters.items():
            for name, params in filters.items():
                try:
                    _check_filter(name, params or {})
                except ValueError as err:
                    raise ValueError(f"filters.{domain}.{name}: {err}") from None
        return self


class PhaseCfg(Strict):
    """A pretraining phase (SmolLM3's "stage"): a token budget and the mixture of sources it is drawn from.

    A phase with `rope_theta` is a long-context extension: it starts from the previous phase's
    weights with that RoPE base on the RoPE layers (the playbook's ABF step) and its own `seq_len`.
    """

    name: Name
    tokens: Count
    mixture: dict[Name, float]
    seq_len: int | None = Field(None, gt=0, description="defaults to pretrain.seq_len")
    batch_size: int | None = Field(None, gt=0, description="sequences per optimizer step; defaults to pretrain.batch_size")
    micro_batch_size: int | None = operational(None, gt=0, description="defaults to pretrain.micro_batch_size")
    rope_theta: float | None = Field(None, gt=0, description="set on long-context phases: the raised RoPE base")
    lr: float | None = Field(None, gt=0, description="constant learning rate of a long-context phase; default: min lr")

    @model_validator(mode="after")
    def _weights(self) -> PhaseCfg:
        if not self.mixture:
            raise ValueError("mixture is empty")
        bad = {k: w for k, w in self.mixture.items() if not (0 < w <= 1)}
        if bad:
            raise ValueError(f"mixture weights must be in (0, 1], got {bad}")
        total = sum(self.mixture.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"mixture weights sum to {total:g}, not 1")
        return self

    @property
    def long_context(self) -> bool:
        return self.rope_theta is not None


class ModelCfg(Strict):
    """transformers' SmolLM3 architecture: GQA, NoPE every `no_rope_layer_interval`-th layer, tied embeddings."""

    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    no_rope_layer_interval: int = Field(4, gt=0)
    rope_theta: float = Field(10_000.0, gt=0)
    tie_word_embeddings: bool = True
    init_std: float = Field(0.02, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    vocab_size: int | None = Field(None, gt=0, description="default: the tokenizer's vocabulary size")

    @model_validator(mode="after")
    def _heads(self) -> ModelCfg:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads (GQA groups)")
        return self


class OptimizerCfg(Strict):
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0, description="not applied to embeddings, norms and biases")
    grad_clip: float = Field(1.0, gt=0)
    z_loss: float = Field(0.0, ge=0, description="weight of the logsumexp^2 penalty (0 = off)")
    warmup_steps: int = Field(100, ge=0)
    decay_fraction: float = Field(0.1, ge=0, le=1, description="share of the main phases' steps spent decaying")


class CheckpointCfg(Strict):
    """When checkpoints are written and how many are kept: a resumed run logs the same losses either way."""

    every_steps: int = operational(200, gt=0)
    every_minutes: float = operational(15, gt=0)
    keep_last: int = operational(2, ge=1)


class SpikeCfg(Strict):
    """What to do when a batch's loss jumps above `factor` x its running mean."""

    policy: Literal["warn", "skip", "rollback"] = "warn"
    factor: float = Field(3.0, gt=1)
    warmup_steps: int = Field(20, ge=0, description="no checks before the running mean settles")


STOP_GRACE = (
    "a cancelled task's ranks get SIGTERM, checkpoint and exit; after this long they are killed (a cancel through a Prefect "
    "worker: at most 30 s, when the worker kills the flow's process and the ranks with it)"
)


class SlurmJobCfg(Strict):
    """The trainer's batch job (`launcher.kind: slurm`): `nodes` x `launcher.nproc` ranks started by srun."""

    partition: SlurmWord = "cpu"
    time: SlurmTime = "24:00:00"
    nodes: int = Field(1, gt=0)
    gpus_per_node: int = Field(0, ge=0)
    signal_s: int = Field(300, gt=0, description="USR1 this long before the time limit: the ranks checkpoint and the job requeues")
    sbatch_args: SbatchArgs = {}
    pending_hours: float = operational(24, gt=0, description="a job still waiting to start (or restart) after this long fails its task")


class LauncherCfg(Strict):
    """How trainer processes start: one process, torchrun, the deepspeed launcher (multi-node: hostfile),
    a Slurm batch job (`slurm`) or a Ray task (`ray`: one process, torchrun above one rank, on a worker with
    `nproc x threads_per_rank` CPUs reserved).

    Operational: the global batch is fixed by `batch_size`, and a phase resumes its checkpoints on
    another rank count (through DeepSpeed's universal format when ZeRO shards must be re-split).
    """

    kind: Literal["python", "torchrun", "deepspeed", "slurm", "ray"] = operational("python")
    nproc: int = operational(1, gt=0, description="ranks per node")
    threads_per_rank: int = operational(2, gt=0)
    hostfile: str | None = operational(None)
    slurm: SlurmJobCfg = operational(SlurmJobCfg())
    ray_address: str | None = operational(
        None, pattern=RAY_ADDRESS, description="`kind: ray`: the cluster whose task runs the trainer; default: the one started here"
    )
    stop_grace_s: float = operational(120, ge=0, description=STOP_GRACE)


class ParallelCfg(Strict):
    """Layout used by the planner (training on CPU is data-parallel only)."""

    dp: int = Field(1, gt=0)
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)


class HardwareCfg(Strict):
    """The accelerator the plan is for; `peak_tflops` null on CPU means measure with a matmul probe."""

    name: str = "cpu"
    peak_tflops: float | None = Field(None, gt=0)
    memory_gb: float = Field(24, gt=0)
    assumed_mfu: float = Field(0.3, gt=0, le=1)
    target_days: float | None = Field(None, gt=0)


class PretrainCfg(Strict):
    seq_len: int = Field(gt=0)
    max_epochs: float = Field(4.0, gt=0, description="fail when a phase repeats a source more often")
    phases: list[PhaseCfg] = Field(min_length=1)
    seed: int | None = Field(None, description="initial weights and batch order; default: the recipe's (an ablation varies it alone)")
    batch_size: int = Field(8, gt=0, description="sequences per optimizer step, over all ranks (the global batch)")
    micro_batch_size: int = operational(8, gt=0, description="sequences per rank per forward pass; gradient accumulation fills the rest")
    precision: Literal["fp32", "bf16"] = "fp32"
    zero_stage: int = Field(
        0, ge=0, le=3, description="a change is no resume: ZeRO-0 and sharded optimizer states do not load into each other"
    )
    optimizer: OptimizerCfg = OptimizerCfg()
    checkpoint: CheckpointCfg = operational(CheckpointCfg())
    spike: SpikeCfg = SpikeCfg()
    launcher: LauncherCfg = operational(LauncherCfg())
    parallel: ParallelCfg = operational(ParallelCfg())
    hardware: HardwareCfg = operational(HardwareCfg())
    log_every: int = operational(10, gt=0)
    yarn_factor: float | None = Field(None, gt=1, description="YaRN factor written into the final config")
    tracking: Literal["trackio", "none"] = operational("trackio")
    until_phase: str | None = Field(
        None,
        description="train the phases up to and including this one and leave out the later ones (a proxy run: its "
        "learning-rate schedule then warms up and decays within them)",
    )

    @model_validator(mode="before")
    @classmethod
    def _until(cls, data: Any) -> Any:
        """The phases after `until_phase` are dropped here, once, so every step, schedule and report sees only those trained."""
        if not isinstance(data, dict) or data.get("until_phase") is None or not isinstance(data.get("phases"), list):
            return data
        names = [ph.get("name") if isinstance(ph, dict) else getattr(ph, "name", None) for ph in data["phases"]]
        if data["until_phase"] not in names:
            raise ValueError(f"until_phase: {data['until_phase']!r} is not a phase ({', '.join(map(str, names))})")
        return {**data, "phases": data["phases"][: names.index(data["until_phase"]) + 1]}

    @model_validator(mode="after")
    def _unique(self) -> PretrainCfg:
        names = [s.name for s in self.phases]
        if len(set(names)) != len(names):
            raise ValueError(f"phase names must be unique, got {names}")
        kinds = [s.long_context for s in self.phases]
        if kinds[0] or kinds != sorted(kinds):
            raise ValueError("long-context phases (with rope_theta) come after at least one main phase, at the end")
        for i, phase in enumerate(self.phases):
            if self.phase_batch(phase) % self.phase_micro_batch(phase):
                raise ValueError(
                    f"phases[{i}] ({phase.name}): batch_size {self.phase_batch(phase)} is not a multiple of "
                    f"micro_batch_size {self.phase_micro_batch(phase)}"
                )
        return self

    def phase_seq_len(self, phase: PhaseCfg) -> int:
        return phase.seq_len or self.seq_len

    def phase_batch(self, phase: PhaseCfg) -> int:
        return phase.batch_size or self.batch_size

    def phase_micro_batch(self, phase: PhaseCfg) -> int:
        return phase.micro_batch_size or self.micro_batch_size


class HubChatCfg(Strict):
    """A conversational dataset with a `messages` column: a hub id or a local JSON/Parquet copy."""

    path: str
    split: str = "train"
    limit: int | None = Field(None, gt=0)


# The generated chat task families (postrain/data.py implements one generator per name).
Family = Literal["arithmetic", "word_problem", "reverse_word", "count_letters"]


class ChatDataCfg(Strict):
    generated: int = Field(4000, ge=0, description="examples generated offline (tasks of postrain/data.py)")
    families: dict[Family, float] = {"arithmetic": 0.4, "word_problem": 0.4, "reverse_word": 0.1, "count_letters": 0.1}
    max_value: int = Field(49, gt=0)
    operators: str = Field("+-*", pattern=r"^[-+*]+$", description="operators of the generated arithmetic problems")
    heldout: int = Field(200, gt=0)
    sign_slips: float = Field(
        0.0, ge=0, le=1, description="share of the negative answers whose training solution drops the minus sign (a teacher's flaw)"
    )
    hub: list[HubChatCfg] = []
    dedup_threshold: float = Field(0.9, gt=0, le=1)


class TrainerCfg(Strict):
    """What TRL's trainers share: steps, batch, learning rate, checkpoints.

    A subclass is a post-training trainer: `trainer` names the function that trains it on one rank
    (`module:function`, imported by postrain/run.py only on the ranks of that trainer), and a section of
    `PostrainCfg` typed with it registers it: the planner, the batch check and the launcher find it there.
    """

    trainer: ClassVar[str]
    rows_per_example: ClassVar[int] = 1  # sequences one example puts in a micro-step (APO: chosen and rejected)

    learning_rate: float = Field(gt=0)
    max_steps: int = Field(gt=0)
    batch_size: int = Field(16, gt=0, description="sequences per micro-step, all ranks together (x grad_accum per update)")
    grad_accum: int = Field(1, gt=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    save_steps: int = operational(100, gt=0)
    logging_steps: int = operational(10, gt=0)
    max_length: int = Field(256, gt=0)
    seed: int | None = Field(None, description="this trainer's seed; default: the recipe's (an ablation varies it to repeat a step)")

    def longest(self) -> int:
        """The longest sequence a micro-step holds (the planner sizes activations by it)."""
        return self.max_length

    def unused_modules(self) -> tuple[str, ...]:
        """Installed packages this trainer's ranks never use, hidden from the probes that would import them anyway
        (`infra.env.skip_unused_imports`)."""
        return ()


class SFTCfg(TrainerCfg):
    trainer: ClassVar[str] = "postrain.sft:run_sft"
    packing: bool = Field(False, description="TRL padding-free packing (no cross-example attention)")
    weak_checkpoint_step: int = Field(50, gt=0, description="an early copy kept as the weak model for preference pairs")

    @model_validator(mode="after")
    def _weak_in_range(self) -> SFTCfg:
        if self.weak_checkpoint_step > self.max_steps:
            raise ValueError(f"weak_checkpoint_step {self.weak_checkpoint_step} is past max_steps {self.max_steps}")
        return self


class GenerationCfg(Strict):
    """How post-training steps score their model on the held-out prompts (greedy generation)."""

    backend: Literal["auto", "vllm", "transformers"] = "auto"
    max_new_tokens: int = Field(64, gt=0)
    batch_size: int = operational(64, gt=0)


class PreferenceCfg(Strict):
    backend: Literal["auto", "vllm", "transformers"] = "auto"
    strong: str | None = Field(None, description="model path; default: the SFT model")
    weak: str | None = Field(None, description="model path; default: the early SFT checkpoint")
    prompts: int = Field(1000, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(0.0, ge=0)
    batch_size: int = operational(64, gt=0)
    dedup_threshold: float = Field(0.9, gt=0, le=1)


class APOCfg(TrainerCfg):
    trainer: ClassVar[str] = "postrain.apo:run_apo"
    rows_per_example: ClassVar[int] = 2
    beta: float = Field(0.05, gt=0)
    loss_type: list[str] = ["apo_zero"]
    loss_weights: list[float] | None = Field(None, description="one weight per loss_type (TRL's default: all 1)")

    @model_validator(mode="after")
    def _one_weight_per_loss(self) -> APOCfg:
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} weights for {len(self.loss_type)} loss types {self.loss_type}")
        return self


class GRPOCfg(TrainerCfg):
    trainer: ClassVar[str] = "postrain.grpo:run_grpo"
    num_generations: int = Field(8, gt=1)
    max_completion_length: int = Field(64, gt=0)
    loss_type: str = "dapo"
    temperature: float = Field(1.0, gt=0)
    target_length: int | None = Field(None, gt=0, description="tokens; longer answers are penalised linearly")
    soft_overlong: tuple[int, int] | None = Field(None, description="(max_completion_len, soft_cache_len) for TRL's punishment")
    reward_weights: dict[str, float] = {"correctness": 1.0, "length": 0.5}
    prompts: int = Field(1000, gt=0)
    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="rollouts: vLLM colocated in each rank (auto: when installed) or transformers' generate"
    )
    vllm_memory: float = operational(0.3, gt=0, le=1, description="GPU memory fraction of the colocated engine (CUDA only)")

    def longest(self) -> int:
        return self.max_length + self.max_completion_length

    def unused_modules(self) -> tuple[str, ...]:
        """vLLM, when rollouts use transformers' generate: TRL's GRPO module imports it whenever it is installed, 6-7 of
        a rank's 14-15 CPU s of imports (docs/developing.md)."""
        return ("vllm",) if self.backend == "transformers" else ()

    @model_validator(mode="after")
    def _grpo(self) -> GRPOCfg:
        if (self.batch_size * self.grad_accum) % self.num_generations:
            raise ValueError("batch_size x grad_accum must be a multiple of num_generations (whole groups)")
        unknown = sorted(set(self.reward_weights) - {"correctness", "length"})
        if unknown:
            raise ValueError(f"unknown reward {unknown[0]!r}; rewards: correctness, length")
        return self


class AccelerateCfg(Strict):
    """How the TRL trainers start: `accelerate launch` on `nproc` ranks of one node (gloo on CPU).

    `nproc` is operational: a trainer's `batch_size` is summed over the ranks (each takes
    batch_size / nproc), so another rank count trains the same global batch.
    """

    nproc: int = operational(1, gt=0, description="ranks (one per GPU)")
    threads_per_rank: int = operational(2, gt=0)
    stop_grace_s: float = operational(120, ge=0, description=STOP_GRACE)
    zero_stage: int = Field(
        0, ge=0, le=3, description="DeepSpeed ZeRO stage (0: plain DDP); a change is no resume: the checkpoint formats differ"
    )


class PostrainCfg(Strict):
    """SFT -> preference pairs (strong vs weak) -> APO -> GRPO, each with TRL (postrain/)."""

    data: ChatDataCfg = ChatDataCfg()
    heldout_eval: GenerationCfg = GenerationCfg()
    launcher: AccelerateCfg = AccelerateCfg()
    sft: SFTCfg
    preference: PreferenceCfg = PreferenceCfg()
    apo: APOCfg
    grpo: GRPOCfg
    tracking: Literal["trackio", "none"] = operational("trackio")  # the trainers' curves in the run's dashboard

    @classmethod
    def trainer_types(cls) -> dict[str, type[TrainerCfg]]:
        """The trainer registry: every section typed with a TrainerCfg, by name, in recipe order."""
        fields = cls.model_fields.items()
        return {name: f.annotation for name, f in fields if isinstance(f.annotation, type) and issubclass(f.annotation, TrainerCfg)}

    def trainers(self) -> dict[str, TrainerCfg]:
        return {name: getattr(self, name) for name in self.trainer_types()}

    @model_validator(mode="after")
    def _split_over_ranks(self) -> PostrainCfg:
        n = self.launcher.nproc
        for name, cfg in self.trainers().items():
            if cfg.batch_size % n:
                raise ValueError(f"{name}.batch_size {cfg.batch_size} is not a multiple of launcher.nproc {n}")
        return self


class EvalCfg(Strict):
    """lm-evaluation-harness on every pretraining checkpoint and every finished model (tasks/evaluation/)."""

    checkpoint_tasks: list[str] = Field([], description="lm-eval tasks run on every pretraining checkpoint (CF, MCF, perplexity)")
    model_tasks: list[str] = Field([], description="extra tasks for finished models (chat template applied), e.g. generative math")
    task_dirs: list[str] = Field(["configs/evals/tasks"], description="folders of lm-eval task YAMLs")
    include_defaults: bool = Field(False, description="also index lm-eval's built-in tasks (HellaSwag, MMLU, ...): ~35 s per call")
    limit: int | None = Field(None, gt=0, description="items per task (None: all)")
    batch_size: int = operational(16, gt=0)
    max_length: int | None = Field(None, gt=0, description="context for perplexity windows (default: the model's)")
    backend: Literal["hf", "vllm"] = "hf"
    follow: bool = operational(True, description="evaluate pretraining checkpoints while the trainer runs")
    poll_seconds: float = operational(10, gt=0)
    nice: int = operational(10, ge=0, le=19, description="CPU priority of eval processes below the trainer's")
    timeout_minutes: float = operational(60, gt=0, description="an evaluation child running longer is killed and reported")
    threads: int = operational(1, ge=1, description="threads of an eval process beside a trainer (a stage's own evals use every core)")
    select: Literal["all", "auto"] = operational(
        "all", description="ablations: verdicts on every task (all), or only on tasks the early-signal checks find usable (auto)"
    )


class Recipe(Strict):
    name: Name
    seed: int = 0
    executor: ExecutorCfg = ExecutorCfg()
    storage: StorageCfg = StorageCfg()
    sources: list[SourceCfg] = Field(min_length=1)
    embedded: EmbeddedCorpusCfg = EmbeddedCorpusCfg()
    curate: CurateCfg
    model: ModelCfg
    pretrain: PretrainCfg
    postrain: PostrainCfg
    evaluation: EvalCfg = EvalCfg()

    @model_validator(mode="after")
    def _cross_refs(self) -> Recipe:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        for i, source in enumerate(self.sources):
            if source.domain not in self.curate.filters:
                raise ValueError(
                    f"sources[{i}] ({source.name}): domain {source.domain!r} has no filter set in curate.filters "
                    f"(have: {', '.join(sorted(self.curate.filters)) or 'none'}); give it one, even an empty {{}}"
                )
        for i, phase in enumerate(self.pretrain.phases):
            unknown = sorted(set(phase.mixture) - set(names))
            if unknown:
                raise ValueError(f"pretrain.phases[{i}].mixture: unknown source {unknown[0]!r} (sources: {names})")
        return self

    def source(self, name: str) -> SourceCfg:
        return next(s for s in self.sources if s.name == name)


def operational_key(key: str, model: type[BaseModel] | None = None) -> bool:
    """Whether a dotted recipe key (`pretrain.launcher.nproc`, `pretrain.phases.0.tokens`) lies under an
    operational field, so that changing it reruns no step."""
    model = model or Recipe
    for part in key.split("."):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            continue  # a list index or a dict key: stay on the same model
        if is_operational(field):
            return True
        model = next((a for a in _models_in(field.annotation)), None)
    return False


def _models_in(annotation: Any):
    """The pydantic models an annotation holds (`PhaseCfg` in `list[PhaseCfg]`, `S3Cfg | None`...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith("function-after") and not str(part).startswith("function-before"):
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_validation_error(err: ValidationError, source: str, what: str = "recipe") -> str:
    lines = [f"{source}: invalid {what} ({err.error_count()} problem{'s' if err.error_count() > 1 else ''})"]
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (misspelt?)"
        lines.append(f"  {_loc(e['loc'])}: {msg}")
    return "\n".join(lines)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Set `a.b.0.c=value` in nested recipe data; the value is parsed as YAML."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set {assignment.partition('=')[0]!r}: expected key.path=value")
    if _sets_secret(key.split("."), yaml.safe_load(raw)):
        raise RecipeError(
            f"--set {key}: credentials are never given as overrides (a flow run stores its parameters, overrides "
            "included, in plain text); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment of the process "
            "or worker that runs the flow"
        )
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"--set {key}: {'.'.join(parts[:i]) or 'recipe'} has no item {part}")
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise RecipeError(f"--set {key}: {'.'.join(parts[:i])} is not a mapping")
    last, value = parts[-1], yaml.safe_load(raw)
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise RecipeError(f"--set {key}: no item {last}")
        node[int(last)] = value
    else:
        node[last] = value


def _sets_secret(parts: list[str], value: Any) -> bool:
    """Whether setting a dotted key to VALUE sets a secret field of the schema (directly or inside a mapping)."""
    if isinstance(value, dict):
        return any(_sets_secret([*parts, str(k)], v) for k, v in value.items())
    return ".".join("N" if p.isdigit() else p for p in parts) in secret_keys()


@functools.cache
def secret_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """The dotted recipe keys of secret fields (`storage.s3.key`, ...), read from the schema (a list item: `N`): what
    `--set` and a deployment's overrides refuse."""
    keys = []
    for name, field in (model or Recipe).model_fields.items():
        types = get_args(field.annotation) or (field.annotation,)
        if SecretStr in types:
            keys.append(prefix + name)
        for sub in _models_in(field.annotation):
            keys += secret_keys(sub, f"{prefix}{name}.{'N.' if _is_list(field.annotation) else ''}")
    return keys


def _is_list(annotation: Any) -> bool:
    return any(getattr(t, "__origin__", None) is list for t in (annotation, *get_args(annotation)))


def secret_override_pattern() -> str:
    """A regular expression that matches an override setting a secret, directly (`storage.s3.secret=...`) or inside a
    mapping given to a key above it (`storage.s3={secret: ...}`); built from the schema, so a new secret is covered."""
    alternatives = []
    for key in secret_keys():
        parts = [r"\d+" if p == "N" else re.escape(p) for p in key.split(".")]
        alternatives.append(r"\.".join(parts) + r"\s*=")
        leaf = parts[-1]
        alternatives += [r"\.".join(parts[:i]) + rf"\s*=.*\b{leaf}\s*:" for i in range(1, len(parts))]
    return r"^\s*(" + "|".join(alternatives) + ")"


# A deployment's `overrides` item: its JSON schema refuses a secret, so the Prefect server answers 409 before it stores
# the flow run and its parameters in plain text (the flow refuses it too, apply_override, but only once it runs).
Override = Annotated[
    str,
    WithJsonSchema(
        {"type": "string", "not": {"pattern": secret_override_pattern()}, "description": "key.path=value (YAML) or @overlay.yaml"}
    ),
]


def parse_recipe(data: Any, source: str) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, source)) from None


def read_yaml(path: Path, what: str = "recipe") -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path}: {what} file not found") from None
    except yaml.YAMLError as err:  # its place and problem only: PyYAML's message quotes the line, which may hold a secret
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        raise RecipeError(f"{path}: not valid YAML at {where}: {getattr(err, 'problem', None) or type(err).__name__}") from None


def overlay(assignment: str) -> list[str]:
    """An override as `key=value` assignments: `@FILE` names an overlay, a YAML mapping of dotted keys to
    values (configs/overlays/), so a deployment run or `--set` switches several keys by one name."""
    if not assignment.startswith("@"):
        return [assignment]
    path = Path(assignment[1:])
    if path.suffix not in (".yaml", ".yml"):  # `@~/.aws/credentials` must not be read into a recipe, a log or a database
        raise RecipeError(f"{path}: an overlay is a .yaml or .yml file")
    data = read_yaml(path, "overlay")
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise RecipeError(f"{path}: an overlay is a mapping of dotted recipe keys to values")
    return [f"{key}={json.dumps(value)}" for key, value in data.items()]


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    path = Path(path)
    data = read_yaml(path)
    for assignment in [a for o in overrides for a in overlay(o)]:
        apply_override(data, assignment)
    return parse_recipe(data, str(path))


def recipe_dump(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain data, secrets masked (safe to write into manifests and logs)."""
    return recipe.model_dump(mode="json")
