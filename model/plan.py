"""The planner: tokens, steps, FLOPs, memory per GPU and GPUs needed for each pretraining phase, and
the ranks, batch and memory per GPU of each post-training trainer; and the measured matmul peak that
MFU divides by (torch only: the flow process measures it without importing transformers).

Compute follows the playbook's convention (6·N·D for training, attention added separately);
memory per GPU counts bf16 weights and gradients, fp32 master weights and Adam moments (16 bytes
per parameter in all) and activations, with each ZeRO stage sharding one more of them over DP.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from infra.recipe import ModelCfg, PostrainCfg, PretrainCfg
from model.config import Arch

GiB = 2**30


Shape = Arch | ModelCfg  # what the arithmetic reads: the network's architecture, or the recipe's with its vocabulary filled in


def count_params(shape: Shape) -> int:
    """Parameters of the architecture, computed from its shape (the planner needs it without a model)."""
    h, i, layers = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    kv = shape.num_key_value_heads * (h // shape.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    embeddings = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return embeddings + layers * per_layer + h


def flops_per_token(shape: Shape, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weights plus the attention scores (6 * layers * seq * hidden)."""
    return 6 * count_params(shape) + 6 * shape.num_hidden_layers * seq_len * shape.hidden_size


def measure_peak_flops(precision: str = "fp32", seconds: float = 1.5) -> float:
    """Achieved matmul FLOP/s of this process's device in the run's precision (the MFU denominator):
    on a GPU, the median of 8192^3 products on random data (zeros run faster than real weights); on a
    CPU, 1024^3 fp32 products, the best of several short probes, so that a moment of contention from
    other processes does not lower it."""
    import torch  # here, not at the top: the flows plan without torch

    if torch.cuda.is_available():
        n, dtype = 8192, torch.bfloat16 if precision == "bf16" else torch.float32
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
        times = []
        for _ in range(13):  # 3 warm-ups
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return 2 * n**3 / sorted(times[3:])[5]
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(5):
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 5:
            a @ b
            done += 1
        best = max(best, 2 * n**3 * done / (time.perf_counter() - start))
    return best


def with_vocab(m: ModelCfg, vocab_size: int) -> ModelCfg:
    """The recipe's architecture with the vocabulary the model gets (model.vocab_size, else the tokenizer's)."""
    return m.model_copy(update={"vocab_size": m.vocab_size or vocab_size})


def gpus_needed(flops: float, peak_flops: float, mfu: float, seconds: float) -> float:
    """GPUs that deliver `flops` in `seconds` at `mfu` of `peak_flops` each."""
    return flops / (peak_flops * mfu * seconds)


def memory_per_gpu(params: int, zero_stage: int, dp: int, tp: int, pp: int, activations: float) -> dict[str, float]:
    """Bytes per GPU: bf16 weights (2), bf16 grads (2), fp32 master + Adam m and v (12) per parameter."""
    shard = params / (tp * pp)
    weights, grads, optimizer = 2 * shard, 2 * shard, 12 * shard
    if zero_stage >= 1:
        optimizer /= dp
    if zero_stage >= 2:
        grads /= dp
    if zero_stage >= 3:
        weights /= dp
    return {
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
        "activations": activations,
        "total": weights + grads + optimizer + activations,
    }


def activation_bytes(seq: int, micro_batch: int, hidden: int, layers: int, tp: int, pp: int) -> float:
    """Activations kept for backward (Korthikanti et al.): 34·s·b·h bytes per layer with flash attention,
    which keeps no s x s score matrix (the 5·a·s²·b term of eager attention)."""
    return 34 * seq * micro_batch * hidden / tp * layers / pp


@dataclass
class PhasePlan:
    name: str
    tokens: int
    seq_len: int
    micro_batch: int
    global_batch_tokens: int
    steps: int
    flops_6nd: float
    flops: float
    memory: dict[int, dict[str, float]]
    problems: list[str] = field(default_factory=list)


@dataclass
class Plan:
    params: int
    gpus: int  # of the recipe's layout: DP x TP x PP
    total_tokens: int
    gpus_needed: float | None  # for the whole run in hardware.target_days at hardware.assumed_mfu
    phases: list[PhasePlan]


def plan(m: ModelCfg, p: PretrainCfg, vocab_size: int) -> Plan:
    par, hw = p.parallel, p.hardware
    arch = with_vocab(m, vocab_size)
    params = count_params(arch)
    gpus = par.dp * par.tp * par.pp
    total_tokens = sum(s.tokens for s in p.phases)
    plans = []
    for phase in p.phases:
        seq, mb, batch = p.phase_seq_len(phase), p.phase_micro_batch(phase), p.phase_batch(phase)
        gbt = batch * seq
        problems = []
        if batch % (par.dp * mb):
            problems.append(f"batch_size {batch} is not a multiple of DP {par.dp} x micro-batch {mb}")
        if m.num_attention_heads % par.tp or m.num_key_value_heads % par.tp:
            problems.append(f"TP {par.tp} does not divide the attention heads ({m.num_attention_heads}/{m.num_key_value_heads})")
        if m.num_hidden_layers % par.pp:
            problems.append(f"PP {par.pp} does not divide the {m.num_hidden_layers} layers")
        act = activation_bytes(seq, mb, m.hidden_size, m.num_hidden_layers, par.tp, par.pp)
        memory = {z: memory_per_gpu(params, z, par.dp, par.tp, par.pp, act) for z in range(4)}
        if memory[p.zero_stage]["total"] > hw.memory_gb * GiB:
            problems.append(
                f"needs {memory[p.zero_stage]['total'] / GiB:.1f} GiB per GPU with ZeRO-{p.zero_stage}, "
                f"over the {hw.memory_gb:g} GiB of a {hw.name}"
            )
        plans.append(
            PhasePlan(
                phase.name,
                phase.tokens,
                seq,
                mb,
                gbt,
                math.ceil(phase.tokens / gbt),
                6 * params * phase.tokens,
                flops_per_token(arch, seq) * phase.tokens,
                memory,
                problems,
            )
        )
    needed = None
    if hw.peak_tflops and hw.target_days:
        needed = gpus_needed(6 * params * total_tokens, hw.peak_tflops * 1e12, hw.assumed_mfu, hw.target_days * 86400)
    return Plan(params, gpus, total_tokens, needed, plans)


@dataclass
class TrainerPlan:
    name: str
    ranks: int
    zero_stage: int
    per_rank: int  # sequences per micro-step on each rank
    global_batch: int  # sequences per optimizer update
    seq_len: int  # the longest sequence a micro-step holds
    memory: dict[str, float]
    problems: list[str] = field(default_factory=list)


def trainer_plans(m: ModelCfg, post: PostrainCfg, vocab_size: int, memory_gb: float) -> list[TrainerPlan]:
    """Every registered trainer (SFT, APO, GRPO) on `post.launcher`: the same 16 bytes per parameter as pretraining, sharded by
    the launcher's ZeRO stage over its ranks, plus activations of the longest micro-step (APO holds a
    chosen and a rejected answer per pair; GRPO a prompt and its completion). Rollout engines (vLLM) not counted."""
    launcher = post.launcher
    params, n, z = count_params(with_vocab(m, vocab_size)), launcher.nproc, launcher.zero_stage
    plans = []
    for name, cfg in post.trainers().items():
        seqs, seq = cfg.rows_per_example, cfg.longest()
        per_rank = cfg.batch_size // n
        act = activation_bytes(seq, per_rank * seqs, m.hidden_size, m.num_hidden_layers, 1, 1)
        memory = memory_per_gpu(params, z, n, 1, 1, act)
        problems = []
        if memory["total"] > memory_gb * GiB:
            problems.append(f"needs {memory['total'] / GiB:.1f} GiB per GPU with ZeRO-{z} on {n} ranks, over {memory_gb:g} GiB")
        plans.append(TrainerPlan(name, n, z, per_rank, cfg.batch_size * cfg.grad_accum, seq, memory, problems))
    return plans
