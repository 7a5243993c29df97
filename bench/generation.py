"""Benchmark: chat generation with transformers' generate against vLLM (the installed build), same prompts.

For each model size (the tiny recipe's ~1.7M-parameter SmolLM3 and a ~30M one, random weights, the
tiny recipe's tokenizer size) both engines answer the same chat prompts greedily with exactly
`--tokens` new tokens each (EOS ignored, so both produce the same number), on the same cores, one after
the other in this run. transformers runs here in batches of 64 (the recipe's default); vLLM in a child
process as the pipeline runs it, whose engine start-up (import + load + KV cache) is reported apart
from its generation. Usage:  .venv/bin/python bench/generation.py [--prompts 256] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from infra.env import apply_offline_defaults, vllm_build, vllm_engine_args  # noqa: E402
from infra.recipe import ModelCfg  # noqa: E402
from model.network import build_model, model_config, save_pretrained  # noqa: E402
from postrain import data as chat  # noqa: E402
from tasks.curation import tokenizer as bpe  # noqa: E402

SIZES = {
    "tiny (recipe)": ModelCfg(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2),
    "~30M": ModelCfg(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
}


def save_model(root: Path, cfg: ModelCfg, tokenizer) -> tuple[Path, int]:
    tok = bpe.save_hf(tokenizer, root)
    special = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    model = build_model(model_config(cfg, len(tok), 1024, special_ids=special), seed=0)
    save_pretrained(model, root)
    return root, sum(p.numel() for p in model.parameters())


def transformers_run(model_dir: Path, prompts: list, tokens: int, batch_size: int = 64) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    loaded = time.perf_counter()
    produced = 0
    for i in range(0, len(prompts), batch_size):
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in prompts[i : i + batch_size]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        produced += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return {"start_s": loaded - start, "generate_s": time.perf_counter() - loaded, "tokens": produced}


def vllm_run(model_dir: Path, prompts: list, tokens: int) -> dict:
    """In this (child) process: import, engine start, then generation, each timed."""
    start = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), seed=0, **vllm_engine_args(torch.cuda.is_available()))
    up = time.perf_counter()
    outs = llm.chat(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    done = time.perf_counter()
    return {"start_s": up - start, "generate_s": done - up, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def vllm_in_child(model_dir: Path, prompts: list, tokens: int, work: Path) -> dict:
    request = work / "prompts.json"
    request.write_text(json.dumps(prompts))
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(model_dir), str(request), "--tokens", str(tokens)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"vLLM child failed:\n{proc.stderr[-3000:]}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    stats["start_s"] = time.perf_counter() - began - stats["generate_s"]  # process start + imports + engine
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per prompt (both engines produce exactly this many)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "PROMPTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    apply_offline_defaults()
    if args.child:
        print(json.dumps(vllm_run(Path(args.child[0]), json.loads(Path(args.child[1]).read_text()), args.tokens)))
        return
    build = vllm_build()
    if build is None:
        sys.exit("no vLLM installed: `make setup` installs the CPU build")
    prompts = [i["prompt"] for i in chat.generate(args.prompts, {"arithmetic": 0.5, "word_problem": 0.5}, 20, 0)]
    print(f"{build}; {args.prompts} chat prompts x {args.tokens} new tokens, greedy; torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        texts = [m["content"] for item in chat.generate(4000, {"arithmetic": 0.5, "word_problem": 0.5}, 20, 1) for m in item["messages"]]
        tokenizer = bpe.train_bpe(iter(texts), vocab_size=4096, min_frequency=2)
        print(f"{'model':<16}{'params':>8}{'transformers tok/s':>20}{'vLLM tok/s':>12}{'ratio':>8}{'vLLM start-up s':>17}{'HF load s':>11}")
        for name, cfg in SIZES.items():
            model_dir, params = save_model(work / name.split()[0], cfg, tokenizer)
            hf = transformers_run(model_dir, prompts, args.tokens)
            vl = vllm_in_child(model_dir, prompts, args.tokens, work)
            assert hf["tokens"] == vl["tokens"] == args.prompts * args.tokens, (hf, vl)
            hf_rate, vl_rate = hf["tokens"] / hf["generate_s"], vl["tokens"] / vl["generate_s"]
            print(
                f"{name:<16}{params / 1e6:>7.1f}M{hf_rate:>20,.0f}{vl_rate:>12,.0f}{vl_rate / hf_rate:>7.2f}x"
                f"{vl['start_s']:>17.1f}{hf['start_s']:>11.1f}"
            )
            hf_all, vl_all = hf["start_s"] + hf["generate_s"], vl["start_s"] + vl["generate_s"]
            print(f"{'':<16}with start-up: transformers {hf_all:.1f} s, vLLM {vl_all:.1f} s ({hf_all / vl_all:.2f}x)")


if __name__ == "__main__":
    main()
