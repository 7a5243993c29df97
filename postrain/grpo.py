"""GRPO with TRL: a verifiable correctness reward plus a length penalty, combined by `reward_weights`.

The length penalty is a linear one past a target length (the playbook aimed at ~2k tokens of
reasoning, penalising from ~2.5-3k) and/or TRL's soft overlong punishment (DAPO). Rollouts come
from vLLM in TRL's colocate mode (an engine inside each rank's process, weights pushed in after each
optimizer step) when `backend` picks it, else from transformers' generate. TRL's server mode is kept
for GPUs: its weight sync needs NCCL. GRPO needs a policy that already solves some prompts: a group
whose answers are all wrong carries no signal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.rewards import get_soft_overlong_punishment

from infra.env import apply_vllm_defaults, vllm_engine_args
from infra.recipe import GRPOCfg
from postrain.common import train_and_save, trl_args
from postrain.data import is_correct
from postrain.generation import resolve_backend


def _text(completion: Any) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correctness(completions: list, answer: list[str], **_: Any) -> list[float]:
    """1 when the completion's final answer matches the reference, else 0."""
    return [1.0 if is_correct(_text(c), a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def length_penalty(target: int) -> Callable[..., list[float]]:
    """0 up to `target` tokens, then -1 per further `target` tokens (linear)."""

    def length(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [-max(0, len(ids) - target) / target for ids in completion_ids]

    return length


def reward_functions(cfg: GRPOCfg) -> tuple[list[Callable], list[float]]:
    funcs, weights = [], []
    if "correctness" in cfg.reward_weights:
        funcs.append(correctness)
        weights.append(cfg.reward_weights["correctness"])
    if "length" in cfg.reward_weights:
        if cfg.target_length:
            funcs.append(length_penalty(cfg.target_length))
            weights.append(cfg.reward_weights["length"])
        if cfg.soft_overlong:
            funcs.append(get_soft_overlong_punishment(*cfg.soft_overlong))
            weights.append(cfg.reward_weights["length"])
    return funcs, weights


def run_grpo(
    model_path: str, items: list[dict[str, Any]], cfg: GRPOCfg, out: Path, seed: int, tracking: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train on the first `cfg.prompts` ITEMS with a reference answer (none: nothing to verify)."""
    items = [i for i in items if i["answer"]][: cfg.prompts]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    funcs, weights = reward_functions(cfg)
    vllm = resolve_backend(cfg.backend) == "vllm"
    if vllm:
        apply_vllm_defaults()
        if not torch.cuda.is_available():
            keep_plain_engine_weights()
            start_engine_as_elsewhere()
    args = trl_args(
        GRPOConfig,
        cfg,
        out,
        seed,
        tracking,
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        loss_type=cfg.loss_type,
        temperature=cfg.temperature,
        reward_weights=weights,
        use_vllm=vllm,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": cfg.vllm_memory} if vllm else {}),
    )
    dataset = Dataset.from_list([{"prompt": i["prompt"], "answer": i["answer"]} for i in items])
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=dataset, processing_class=tokenizer)
    if vllm:
        unwrap_vllm_compile(model)
    return train_and_save(trainer, out, {"reward": "reward", "completion_length": "completions/mean_length"})


def keep_plain_engine_weights() -> None:
    """Let TRL push the policy's weights into a colocated engine on CPU.

    Once it has loaded a model, vLLM's CPU build (0.32) hands each linear layer's weight to a packed
    oneDNN kernel where the CPU has one (AVX-512 here) and frees the weight itself
    (`dispatch_cpu_unquantized_gemm`), so TRL's sync after each step finds empty parameters, and the
    packed copy would go stale anyway. The colocated engine uses vLLM's own fallback instead: torch's
    linear on the weights as loaded, which the sync then updates in place.
    """
    from vllm.model_executor.layers import utils

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    utils.dispatch_cpu_unquantized_gemm = plain_linear


def start_engine_as_elsewhere() -> None:
    """Start the colocated engine on CPU with `vllm_engine_args`, as every other engine here; TRL's own keywords win.

    TRL passes no `enforce_eager`, so vLLM compiled the model at every launch (torch.compile, g++), and its
    torch.compiled log-prob count too, for seconds of generation: 25 of a vLLM test's 69 CPU s (docs/developing.md).
    Nothing in the rank compiles on purpose, so torch.compile is turned off for all of it.
    """
    import functools

    import torch._dynamo
    from trl.generation import vllm_generation

    vllm_generation.LLM = functools.partial(vllm_generation.LLM, **vllm_engine_args(cuda=False))
    torch._dynamo.config.disable = True


def unwrap_vllm_compile(model: torch.nn.Module) -> None:
    """Let the policy train after a colocated engine loaded its own copy.

    vLLM serves SmolLM3 (and other architectures it has no native code for) through its transformers
    backend, which wraps the transformers class itself, not a copy, for torch.compile. The policy was
    built before the wrap, so its modules lack the wrapper's state (`do_not_compile`) and the first
    forward fails; marked uncompiled, the wrapper calls their plain forward.
    """
    for module in model.modules():
        if type(module).__call__ is not torch.nn.Module.__call__ and not hasattr(module, "do_not_compile"):
            module.do_not_compile = True
