"""Inference backends for chat generation: vLLM on GPUs (the `[gpu]` extra), transformers on CPU.

Both take a list of conversations and return one completion per conversation. `make_backend`
picks vLLM when CUDA and vllm are both present, unless the recipe forces a backend.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Protocol

import torch


class Backend(Protocol):
    tokenizer: Any

    def chat(self, conversations: list[list[dict[str, str]]], max_new_tokens: int, temperature: float) -> list[str]: ...


def stop_token_ids(tokenizer) -> list[int]:
    """A chat turn ends at <|im_end|>; a document at the tokenizer's EOS."""
    ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    return [i for i in dict.fromkeys(ids) if i is not None and i != tokenizer.unk_token_id]


class TransformersBackend:
    """Batched `generate` with left padding (the CPU path)."""

    def __init__(self, model_path: str, batch_size: int = 32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.batch_size = batch_size

    def chat(self, conversations: list[list[dict[str, str]]], max_new_tokens: int, temperature: float) -> list[str]:
        out = []
        for start in range(0, len(conversations), self.batch_size):
            batch = conversations[start : start + self.batch_size]
            texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in batch]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
            with torch.no_grad():
                ids = self.model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=stop_token_ids(self.tokenizer),
                    pad_token_id=self.tokenizer.pad_token_id,
                    **sampling,
                )
            new = ids[:, enc["input_ids"].shape[1] :]
            out += [t.strip() for t in self.tokenizer.batch_decode(new, skip_special_tokens=True)]
        return out


def vllm_request(
    conversations: list[list[dict[str, str]]], max_new_tokens: int, temperature: float, stop_ids: list[int]
) -> tuple[list[list[dict[str, str]]], Any]:
    """The arguments of `vllm.LLM.chat`: the conversations and their SamplingParams."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_ids)
    return conversations, params


class VLLMBackend:
    """vLLM's offline engine (GPU); imported only when chosen."""

    def __init__(self, model_path: str, gpu_memory_utilization: float = 0.85):
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.llm = LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization)

    def chat(self, conversations: list[list[dict[str, str]]], max_new_tokens: int, temperature: float) -> list[str]:
        messages, params = vllm_request(conversations, max_new_tokens, temperature, self.stop_ids)
        return [o.outputs[0].text.strip() for o in self.llm.chat(messages, params, use_tqdm=False)]


def vllm_usable() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def make_backend(kind: str, model_path: str, batch_size: int = 32) -> Backend:
    if kind == "vllm" or (kind == "auto" and vllm_usable()):
        return VLLMBackend(model_path)
    return TransformersBackend(model_path, batch_size)
