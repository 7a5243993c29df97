"""The tokenizer: a byte-level BPE trained on the curated text, saved in Hugging Face format.

Digits are split one per token (arithmetic generalises better when 123 is not one opaque token).
The ChatML template wraps each assistant turn, including the newline after `<|im_end|>`, in
`{% generation %}` markers: TRL's assistant-only loss trains exactly the marked tokens, and a
newline left outside would never be learnt, skewing later preference log-probs.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from infra.steps import TOKENIZER_FILES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>", PAD]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def sample_texts(source_dirs: list[Path], max_bytes: int) -> Iterator[str]:
    """Documents taken round-robin across sources until `max_bytes` of text, so no source dominates."""
    readers = [_docs(d) for d in source_dirs]
    taken = 0
    while readers and taken < max_bytes:
        for reader in list(readers):
            text = next(reader, None)
            if text is None:
                readers.remove(reader)
                continue
            taken += len(text.encode())
            yield text


def _docs(folder: Path) -> Iterator[str]:
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for line in f:
                yield json.loads(line)["text"]


def train_bpe(texts: Iterator[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_hf(tokenizer: Tokenizer, out: Path) -> PreTrainedTokenizerFast:
    """Save as a transformers tokenizer (tokenizer.json + config + chat template).

    `clean_up_tokenization_spaces` is off: that clean-up is for WordPiece, strips the space before
    punctuation in BPE text, and transformers warns on every load of a config that asks for it.
    transformers is imported here, not with the module: every curation task on Slurm or Ray imports
    this module for EOS, and transformers with torch costs it ~5 s of CPU."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False
    )
    hf.save_pretrained(str(out))
    return hf


def copy_existing(tokenizer_json: str, out: Path) -> None:
    """Use an existing tokenizer: its tokenizer.json and the config files beside it."""
    src = Path(tokenizer_json)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src.parent / name).exists():
            shutil.copy2(src.parent / name, out / name)
