"""Packed pretraining batches drawn from the per-source token files by the stage's mixture.

The order of a phase's samples is fixed by (seed, phase): each source contributes exactly the
number of `seq_len` windows its mixture manifest gives it, shuffled together once. Sample `j` is
therefore a pure function of `j`, so a resumed run sees exactly the batches the uninterrupted run
would have, with no reader state to save beyond the step.

Windows are packed: one window may span several documents. Position ids restart at every document
start and that token's label is -100, so the network builds a per-document causal mask from them
(`model.network.document_mask`) and no token attends to, or is predicted from, another document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

IGNORE = -100


class TokenSource:
    """The tokens of one source: datatrove `.ds` files (memory-mapped) and their document ends."""

    def __init__(self, folder: Path):
        files = sorted(Path(folder).glob("*.ds"))
        if not files:
            raise FileNotFoundError(f"no .ds token files in {folder}")
        parts, ends, offset = [], [], 0
        for ds in files:
            first = ds.with_name(ds.name + ".metadata").read_text().splitlines()[0]
            dtype = np.uint32 if first.rsplit("|", 1)[1] == "4" else np.uint16
            tokens = np.memmap(ds, dtype=dtype, mode="r")
            parts.append(tokens)
            ends.append(np.fromfile(str(ds) + ".index", dtype=np.uint64).astype(np.int64) + offset)
            offset += len(tokens)
        self.tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.doc_ends = np.concatenate(ends)
        self.doc_starts = np.concatenate([[0], self.doc_ends[:-1]])

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, index: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """The `index`-th window of `seq_len` tokens (wrapping around: a second epoch) and its position ids."""
        n = len(self.tokens)
        start = (index * seq_len) % n
        positions = (np.arange(seq_len) + start) % n
        tokens = np.asarray(self.tokens[positions], dtype=np.int64)
        doc = np.searchsorted(self.doc_ends, positions, side="right")
        starts_here = positions == self.doc_starts[np.minimum(doc, len(self.doc_starts) - 1)]
        starts_here[0] = True  # a window that opens mid-document restarts its positions too
        index = np.arange(seq_len)
        last_start = np.maximum.accumulate(np.where(starts_here, index, 0))
        return tokens, index - last_start


@dataclass(frozen=True)
class SampleOrder:
    """Which source and which window every sample of a phase reads."""

    source_of: np.ndarray  # sample -> source index
    window_of: np.ndarray  # sample -> window index within its source


def sample_order(samples_per_source: list[int], seed: int, phase_index: int) -> SampleOrder:
    source_of = np.repeat(np.arange(len(samples_per_source), dtype=np.int32), samples_per_source)
    rng = np.random.default_rng([seed, phase_index])
    rng.shuffle(source_of)
    window_of = np.empty(len(source_of), dtype=np.int64)
    for s in range(len(samples_per_source)):
        where = source_of == s
        window_of[where] = np.arange(where.sum())
    return SampleOrder(source_of, window_of)


class MixtureBatches:
    """Batches of a phase: step `s` trains on samples `s*batch_size ... (s+1)*batch_size - 1`, whatever
    the rank count; `micro_batches(step, rank, world)` is a pure function of its arguments."""

    def __init__(self, sources: list[TokenSource], order: SampleOrder, seq_len: int, micro_batch: int, batch_size: int):
        self.sources, self.plan, self.seq_len = sources, order, seq_len
        self.micro_batch, self.batch_size = micro_batch, batch_size
        self.steps = len(order.source_of) // batch_size

    def micro_batches(self, step: int, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
        """The micro-batches rank `rank` of `world` trains on at optimizer step `step`: its slice of the batch."""
        share = self.batch_size // world
        first = step * self.batch_size + rank * share
        return [
            self.collate([self.sample(j) for j in range(start, min(start + self.micro_batch, first + share))])
            for start in range(first, first + share, self.micro_batch)
        ]

    def sample(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        source = self.sources[self.plan.source_of[j]]
        return source.window(int(self.plan.window_of[j]), self.seq_len)

    @staticmethod
    def collate(samples: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        input_ids = torch.from_numpy(np.stack([s[0] for s in samples]))
        position_ids = torch.from_numpy(np.stack([s[1] for s in samples]))
        labels = input_ids.clone()
        labels[position_ids == 0] = IGNORE  # a document's first token is not predicted from the one before
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
