"""A generated text corpus: Zipf word frequencies and class-dependent topics, no download.

Each class has a topic: ``topic_words`` words of the vocabulary drawn for
it, whose probability a document of the class multiplies by ``boost``.
A document's words are drawn from the vocabulary's Zipf frequencies
(word of rank r: ``r ** -zipf``) reweighted by its class's topic, and its
length from a log-normal around ``mean_length`` words. The documents are
strings ("w17 w3 w17 ..."), so that a ``TfidfVectorizer`` in a
``Pipeline`` reads them as it would real text: common words in every
document, a long tail of rare ones, and a few words that tell the classes
apart, as in topic classification (20 newsgroups, rcv1).
"""

from __future__ import annotations

import numpy as np


def make_text_corpus(
    n_documents: int,
    *,
    vocabulary: int = 30_000,
    n_classes: int = 2,
    mean_length: int = 120,
    zipf: float = 1.1,
    topic_words: int = 300,
    boost: float = 8.0,
    random_state: int = 0,
) -> tuple[list[str], np.ndarray]:
    """``n_documents`` documents (strings of ``w<index>`` words) and their classes ``(n,)``."""
    rng = np.random.default_rng(random_state)
    ranks = np.arange(1, vocabulary + 1, dtype=np.float64)
    base = ranks**-zipf
    # Topic words come from beyond the most common hundred: the commonest
    # words (stop words) are in every class's documents alike.
    topics = [
        rng.choice(np.arange(100, vocabulary), topic_words, replace=False) for _ in range(n_classes)
    ]
    frequencies = []
    for topic in topics:
        weights = base.copy()
        weights[topic] *= boost
        frequencies.append(np.cumsum(weights / weights.sum()))
    labels = rng.integers(n_classes, size=n_documents)
    lengths = np.maximum(5, rng.lognormal(np.log(mean_length), 0.5, n_documents).astype(int))
    words = np.array([f"w{i}" for i in range(vocabulary)], dtype=object)
    documents = []
    for label, length in zip(labels, lengths, strict=True):
        drawn = np.searchsorted(frequencies[label], rng.random(length))
        documents.append(" ".join(words[np.minimum(drawn, vocabulary - 1)]))
    return documents, labels
