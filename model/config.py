"""What one pretraining phase is given: its config (the step's identity) and the job the Prefect task writes.

Kept apart from model/train.py so that the flows, which build and hash these, import neither torch nor
transformers (~10 s per process); the trainer process reads them back from the job file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from infra.errors import DataError
from infra.recipe import CheckpointCfg, ModelCfg, SpikeCfg, Strict, operational


class Schedule(Strict):
    """The learning rate of every step of a phase, resolved from the whole recipe (warmup-stable-decay)."""

    steps: int  # optimizer steps of this phase
    offset: int = 0  # steps of the main phases before this one: the schedule is global
    total: int = 1  # steps of all main phases
    warmup: int = 0
    decay_start: int = 1  # global step where the linear decay to `floor` begins
    peak: float
    floor: float
    constant: float | None = None  # a long-context phase trains at this constant rate

    def lr(self, step: int) -> float:
        if self.constant is not None:
            return self.constant
        g = self.offset + step
        if g < self.warmup:
            return self.peak * (g + 1) / self.warmup
        if g < self.decay_start:
            return self.peak
        progress = min(1.0, (g - self.decay_start + 1) / max(1, self.total - self.decay_start))
        return self.peak + (self.floor - self.peak) * progress


class TrainConfig(Strict):
    """One phase's training: its identity is every field but the operational ones."""

    phase: str
    index: int
    seed: int
    model: ModelCfg
    samples: dict[str, int]  # source name -> seq_len windows this phase draws from it
    seq_len: int
    batch_size: int  # sequences per optimizer step over all ranks
    schedule: Schedule
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    z_loss: float = 0.0
    precision: str = "fp32"
    zero_stage: int = 0
    spike: SpikeCfg = SpikeCfg()
    rope_theta: float | None = None  # a long-context phase: the raised RoPE base
    yarn_factor: float | None = None  # the last phase writes YaRN settings into its final config
    micro_batch_size: int = operational(8)
    checkpoint: CheckpointCfg = operational(CheckpointCfg())
    threads: int = operational(2)
    log_every: int = operational(10)
    tracking: str = operational("trackio")
    project: str = operational("smolflow")  # the trackio project
    peak_flops: float | None = operational(None)  # per rank; a matmul probe when None
    hold_unevaluated: int = operational(0)  # checkpoints kept past keep_last until the evaluator scored them

    @property
    def long_context(self) -> bool:
        return self.rope_theta is not None


class TrainJob(BaseModel):
    """A phase's config plus where things are; written by the Prefect task as JSON (no secrets in it)."""

    model_config = ConfigDict(extra="forbid")

    config: TrainConfig
    sources: dict[str, str]  # source name -> folder of .ds files
    tokenizer_dir: str
    out_dir: str  # the phase's step folder: final HF model, metrics, summary
    checkpoint_dir: str
    init_from: str | None = None  # previous phase's checkpoint root (main phase) or final model (long context)
    init_remote: str | None = None  # the previous phase's checkpoints on the mirror
    remote_name: str = ""  # this phase's checkpoints on the mirror
    mirror: str | None = None  # s3:// prefix for checkpoints; credentials come from the environment
    s3_endpoint: str | None = None
    s3_region: str | None = None
    stop_after_steps: int | None = None  # testing and drills: exit after this many steps of this run


# what this implementation computes: an HF config asking for anything else is refused, not silently ignored
FIXED = {"attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "use_sliding_window": False}


@dataclass
class Arch:
    """The architecture, with the names and meaning of transformers' `SmolLM3Config` (config.json's keys): what
    `model.network` builds, and what the planner counts (without torch)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    no_rope_layer_interval: int = 4
    no_rope_layers: list[int] = field(default_factory=list)  # 1: the layer applies RoPE; 0: NoPE
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if not self.no_rope_layers:  # transformers' rule: every interval-th layer has no RoPE
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(self.num_hidden_layers)]

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """config.json as transformers writes it for SmolLM3 (keys sorted; generation reads `use_cache`)."""
        layers = {"layer_types": ["full_attention"] * self.num_hidden_layers, "sliding_window": None}
        kind = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "use_cache": True}
        return dict(sorted((asdict(self) | FIXED | layers | kind | {"dtype": dtype}).items()))

    @classmethod
    def from_hf(cls, data: dict[str, Any], source: Path | str) -> Arch:
        for key, value in FIXED.items():
            if data.get(key, value) != value:
                raise DataError(f"{source}: {key} = {data[key]!r}; smolflow's SmolLM3 implements {key} = {value!r} only")
        if data.get("model_type") != "smollm3":
            raise DataError(f"{source}: model_type = {data.get('model_type')!r}, not 'smollm3'")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
