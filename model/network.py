"""The network: SmolLM3 in plain PyTorch, saved and loaded as a standard HF checkpoint.

Its parameters carry transformers' names, its init draws the same random numbers in the same order, and its
forward runs the same operations as transformers' `SmolLM3ForCausalLM` on the sdpa path, so weights, losses
and gradients are bit for bit those of the transformers model (tests/test_model.py checks all three, and
that transformers loads what `save_pretrained` writes). A rank then never imports transformers: ~3 CPU s of the
~5 a rank spends starting here, in every pretraining launch (docs/developing.md).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infra.errors import DataError
from infra.recipe import ModelCfg
from infra.steps import HF_CONFIG, TOKENIZER_FILES
from model.config import Arch

WEIGHTS = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"


def model_config(
    cfg: ModelCfg, vocab_size: int, max_positions: int, rope_theta: float | None = None, special_ids: dict[str, int] | None = None
) -> Arch:
    return Arch(
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
        **(special_ids or {}),
    )


def long_context_config(previous: Arch, seq_len: int, rope_theta: float) -> Arch:
    """The previous stage's config with a longer context and a raised RoPE base (NoPE layers unchanged)."""
    return replace(previous, max_position_embeddings=seq_len, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})


def with_yarn(config: Arch, factor: float) -> Arch:
    """Inference-time extrapolation past the trained length (YaRN), written into the final config."""
    trained = config.max_position_embeddings
    theta = config.rope_parameters["rope_theta"]
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": trained}
    return replace(config, max_position_embeddings=int(trained * factor), rope_parameters=rope)


# --- the modules (transformers' names, so the state dict is an HF one) --------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: Arch, use_rope: bool):
        super().__init__()
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.groups = c.num_attention_heads // c.num_key_value_heads
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * self.head_dim, c.hidden_size, bias=False)
        self.use_rope = use_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.use_rope:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scale = self.head_dim**-0.5
        if mask is None:  # one document per row: the causal kernel, GQA inside it
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=self.groups > 1)
        else:  # packed documents: a block-diagonal causal mask, the key/value heads repeated
            k, v = (t[:, :, None].expand(-1, -1, self.groups, -1, -1).flatten(1, 2) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.o_proj(out.transpose(1, 2).contiguous().reshape(*x.shape[:-1], -1).contiguous())


class MLP(nn.Module):
    def __init__(self, c: Arch):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: Arch, use_rope: bool):
        super().__init__()
        self.self_attn = Attention(c, use_rope)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: Arch):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        self.layers = nn.ModuleList(Layer(c, bool(rope)) for rope in c.no_rope_layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def init_weights(module: nn.Module, std: float) -> None:
    """transformers' init, children before parents: normal(std) for linears and embeddings (the padding row
    zero), ones for norms. Applied after torch's own init, as there, so a seed gives transformers' weights."""
    for child in module.children():
        init_weights(child, std)
    with torch.no_grad():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Packed documents (positions restarting inside a row) see only their own earlier tokens: a boolean
    (batch, 1, n, n) mask, as transformers builds it from position ids; None when no row is packed."""
    doc = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    if not (doc[:, -1] != 0).any():
        return None
    n = position_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


class SmolLM3(nn.Module):
    """The causal LM: `model` (embeddings, layers, final norm) and `lm_head`, tied to the embeddings by default."""

    def __init__(self, config: Arch):
        super().__init__()
        if config.rope_parameters.get("rope_type", "default") != "default":  # YaRN is for inference engines, in the final config
            raise DataError(f"rope_type {config.rope_parameters['rope_type']!r}: the network trains with the default RoPE only")
        self.config = config
        self.model = Body(config)
        init_weights(self.model, config.initializer_range)  # transformers initialises the body before building the head
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_weights(self.lm_head, config.initializer_range)
        self.tie()

    def tie(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> SimpleNamespace:
        """Logits for every position (`.logits`, as transformers returns them); `position_ids` restarting at 0
        inside a row mark packed documents, which then do not attend to each other."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.model.embed_tokens(input_ids)
        dim = self.config.hidden_size // self.config.num_attention_heads
        inv_freq = 1.0 / (self.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float, device=x.device) / dim))
        freqs = (inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1) @ position_ids[:, None, :].float()).transpose(1, 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
        mask = document_mask(position_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return SimpleNamespace(logits=self.lm_head(self.model.norm(x)))


def build_model(config: Arch, seed: int) -> SmolLM3:
    """Random init that depends on the seed only (the same weights transformers' SmolLM3 gets from it)."""
    torch.manual_seed(seed)
    return SmolLM3(config)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on embeddings, norms and biases."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        skip = param.ndim < 2 or "embed" in name or "norm" in name or "lm_head" in name
        (no_decay if skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --- HF checkpoints ---------------------------------------------------------------------------------------


def load_config(folder: Path) -> Arch:
    return Arch.from_hf(json.loads((Path(folder) / HF_CONFIG).read_text()), Path(folder) / HF_CONFIG)


def load_model(folder: Path, config: Arch | None = None) -> SmolLM3:
    """An HF SmolLM3 checkpoint's weights in fp32, under CONFIG (default: its own). Built on the meta device,
    so loading draws no random numbers and allocates the weights once."""
    from safetensors.torch import load_file

    state = {key: value.float() for key, value in load_file(Path(folder) / WEIGHTS).items()}
    config = config or load_config(folder)
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    with torch.device("meta"):
        model = SmolLM3(config)
    model.load_state_dict(state, assign=True)
    model.tie()
    return model


def read_tokenizer(folder: Path) -> tuple[int, dict[str, int | None]]:
    """The tokenizer folder's vocabulary size (added tokens included) and the ids of its EOS and padding tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    settings = json.loads((Path(folder) / "tokenizer_config.json").read_text())

    def token_id(key: str) -> int | None:
        token = settings.get(key)
        return tokenizer.token_to_id(token["content"] if isinstance(token, dict) else token) if token else None

    return tokenizer.get_vocab_size(with_added_tokens=True), {"eos_token_id": token_id("eos_token"), "pad_token_id": token_id("pad_token")}


def save_pretrained(model: SmolLM3, folder: Path, tokenizer_dir: Path | None = None, config: Arch | None = None) -> None:
    """An HF checkpoint: safetensors (the tied head left out, as transformers does), config.json,
    generation_config.json, and the tokenizer folder's files when given. CONFIG overrides the model's
    (the final export's YaRN)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = config or model.config
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, folder / WEIGHTS, metadata={"format": "pt"})
    (folder / HF_CONFIG).write_text(
        json.dumps(config.to_hf(str(model.lm_head.weight.dtype).removeprefix("torch.")), indent=2, sort_keys=True) + "\n"
    )
    ids = {key: getattr(config, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(config, key) is not None}
    generation = {"_from_model_config": True, **ids, "output_attentions": False, "output_hidden_states": False, "use_cache": True}
    (folder / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy2(Path(tokenizer_dir) / name, folder / name)
