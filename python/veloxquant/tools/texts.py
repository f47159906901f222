"""Real English text shipped with veloxquant, for the main job and for evaluations.

:func:`alice` is Lewis Carroll's *Alice's Adventures in Wonderland* (1865,
public domain) in the Millennium Fulcrum Edition 2.9 transcription (Project
Gutenberg's etext of 1992, ``alice29.txt``, also part of the Canterbury
corpus), without the etext's header and with each line's indentation
removed: about 40,000 tokens for SmolLM2's tokenizer, twelve chapters.
"""

from __future__ import annotations

from importlib import resources
from typing import List


def alice() -> str:
    """The whole book (``veloxquant/data/alice.txt``)."""
    return resources.files("veloxquant").joinpath("data", "alice.txt").read_text(encoding="utf-8")


def paragraphs(text: str) -> List[str]:
    """The text's paragraphs (blank-line separated)."""
    return [p for p in text.split("\n\n") if p.strip()]


def leading_tokens(text: str, encode, tokens: int) -> str:
    """The longest run of ``text``'s first paragraphs that ``encode`` makes at most ``tokens`` tokens.

    At least the first paragraph is returned.
    """
    paras = paragraphs(text)
    # Candidates: no English text runs to 8 characters a token, so nothing
    # past 8 x tokens characters can fit (and the tokenizer never sees a text
    # longer than it must).
    chars, n = 0, 0
    while n < len(paras) and chars <= 8 * tokens:
        chars += len(paras[n]) + 2
        n += 1
    paras = paras[:n]
    lo, hi = 1, len(paras)
    while lo < hi:  # the most paragraphs that fit
        mid = (lo + hi + 1) // 2
        if len(encode("\n\n".join(paras[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return "\n\n".join(paras[:lo])
