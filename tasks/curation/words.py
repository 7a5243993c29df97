"""Word tokenizers for datatrove's filters, MinHash and decontamination.

datatrove's default English tokenizer is spaCy's; on these machines a regex gives the Gopher
and FineWeb filters the same decisions ~13x faster, and MinHash (which sees already simplified
text) the same decisions ~5x faster with plain `str.split`. Instances are module-level so they
pickle by reference into datatrove's worker processes.
"""

from __future__ import annotations

import regex
from datatrove.utils.word_tokenizers import WordTokenizer

_WORD = regex.compile(r"\w+(?:['’]\w+)*|[^\w\s]+")
_SENTENCE = regex.compile(r"[^.!?\n]+(?:[.!?]+[\"'”)]*|\n|$)")


class RegexWordTokenizer(WordTokenizer):
    """Words and runs of punctuation as separate tokens, as spaCy's blank English model splits them."""

    def word_tokenize(self, text: str) -> list[str]:
        return _WORD.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [s.strip() for s in _SENTENCE.findall(text) if s.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in _SENTENCE.finditer(text) if m.group().strip()]


class SplitWordTokenizer(RegexWordTokenizer):
    """Whitespace split: for text that datatrove has already simplified (punctuation removed)."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()


REGEX_WORDS = RegexWordTokenizer("en")
SPLIT_WORDS = SplitWordTokenizer("en")
