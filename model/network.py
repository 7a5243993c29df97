"""The network: transformers' SmolLM3 built from the recipe, so every checkpoint is a standard HF one."""

from __future__ import annotations

from typing import Any

import torch
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from infra.recipe import ModelCfg


def model_config(
    cfg: ModelCfg, vocab_size: int, max_positions: int, rope_theta: float | None = None, special_ids: dict[str, int] | None = None
) -> SmolLM3Config:
    return SmolLM3Config(
        vocab_size=cfg.vocab_size or vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        no_rope_layer_interval=cfg.no_rope_layer_interval,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta or cfg.rope_theta},
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        use_cache=True,
        **{"pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **(special_ids or {})},
    )


def build_model(config: SmolLM3Config, seed: int) -> SmolLM3ForCausalLM:
    """Random init (normal, std = initializer_range) that depends on the seed only. The embeddings are tied here
    too: while any thread of the process is inside `from_pretrained`, transformers 5 swaps `tie_weights` for a
    no-op class-wide (`initialization.no_tie_weights`), and a model built meanwhile came out untied."""
    torch.manual_seed(seed)
    model = SmolLM3ForCausalLM(config)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return for_training(model)


def for_training(model: SmolLM3ForCausalLM) -> SmolLM3ForCausalLM:
    """No KV cache in training forwards, but one in generation from anything saved from it: `generate`
    reads `generation_config.use_cache`, which a model copies from its config when built, so every phase
    built from a training checkpoint's config exported a model that generated without a cache (11x slower
    at the tiny size, same tokens)."""
    model.config.use_cache = False
    model.generation_config.use_cache = True
    return model


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on embeddings, norms and biases."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        skip = param.ndim < 2 or "embed" in name or "norm" in name or "lm_head" in name
        (no_decay if skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def long_context_config(previous: SmolLM3Config, seq_len: int, rope_theta: float) -> SmolLM3Config:
    """The previous stage's config with a longer context and a raised RoPE base (NoPE layers unchanged)."""
    data = previous.to_dict()
    data["max_position_embeddings"] = seq_len
    data["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    return SmolLM3Config.from_dict(data)


def with_yarn(config: SmolLM3Config, factor: float) -> SmolLM3Config:
    """Inference-time extrapolation past the trained length (YaRN), written into the final config."""
    data = config.to_dict()
    trained = config.max_position_embeddings
    data["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": config.rope_parameters["rope_theta"],
        "factor": factor,
        "original_max_position_embeddings": trained,
    }
    data["max_position_embeddings"] = int(trained * factor)
    return SmolLM3Config.from_dict(data)
