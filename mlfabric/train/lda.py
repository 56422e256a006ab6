"""Distributed LDA by collapsed Gibbs sampling (MLfabric §7's second workload), on a synthetic corpus.

    mlfabric train --workload lda --workers 8 --servers 1 --sync allreduce,ps-async,mlfabric-a:8 --transport tcp
    .venv/bin/python -m pytest tests/unit/test_lda.py tests/local/test_train_lda.py -q

The pieces, each usable alone:

* :func:`synthetic_corpus`: documents drawn from LDA's own generative model (no download,
  seeded): ``topics`` word distributions ``phi_k ~ Dirichlet(beta)`` over a vocabulary of
  ``vocabulary`` words, per document a topic mixture ``theta_d ~ Dirichlet(alpha)`` and a
  length ``~ Poisson(doc_length)`` (at least 2), every token's topic drawn from ``theta_d``
  and its word from that topic. Training documents are sharded across workers by document
  (strided, as the classification tasks are); held-out documents are split into an observed
  first half and a held-out second half (document completion).
* :class:`GibbsSampler`: Griffiths & Steyvers' collapsed Gibbs sampler over one worker's
  documents, AD-LDA style (Newman et al. 2009): a worker sweeps its documents against the
  global word-topic counts as last received plus its own changes since, and what it sends
  is its change (delta) of the word-topic counts. Within a worker the sweep is vectorized
  by token position: the i-th tokens of all documents of the sweep are sampled together
  against the word-topic counts left by the (i-1)-th ones. The document-topic counts and
  each token's exclusion of itself are exact; the only approximation is that tokens of one
  position do not see each other's word-topic moves, the same approximation AD-LDA makes
  across workers at a far coarser grain (a whole sweep of every other worker). In numpy,
  about 0.3 microseconds per token with 20 topics (docs/results.md).
* :func:`document_completion`: the convergence metric, held-out log-likelihood per token,
  higher is better (Wallach et al. 2009's document completion): the topics ``phi`` are
  the model's smoothed word-topic counts; each held-out document's mixture ``theta`` is
  estimated from its observed first half by fixed-point (EM) iterations of the posterior
  mean ``(sum of responsibilities + alpha) / (tokens + K alpha)`` (deterministic, unlike a
  Gibbs fold-in, so the metric has no sampling noise); the score is the mean of ``log
  sum_k theta_dk phi_kw`` over the tokens of the second halves.
* :class:`LdaModel` / :class:`LdaTask`: the workload of ``mlfabric train --workload lda``.

How the count deltas travel through the training harness's modes
----------------------------------------------------------------

``mlfabric train`` trains torch modules with an optimizer, and every mode applies
gradients: allreduce / tree-allreduce average the W workers' gradients and take an SGD step
on every worker; the parameter server's rule (:mod:`mlfabric.ps.rules`) applies ``-lr x
weight x`` the pushed gradients, with weight ``1/W`` for asynchronous updates (aggregated or
not) and ``1/m`` for a BSP round of m gradients. LDA's global state is a matrix of counts,
and every worker's delta must be *added* exactly once. So:

* :class:`LdaModel`'s one parameter is the word-topic count matrix (V x K, float32: exact
  for integers below 2^24), and its forward pass (one sweep) returns a surrogate whose
  gradient is ``-W x delta``;
* the workload's SGD has lr 1 and no momentum: allreduce's average of ``-W delta_i`` is
  ``-sum_i delta_i`` exactly (a sum of integers divisible by W), and the step adds it;
* on the servers (and replicas) the LDA rule :class:`AddCountDeltas` replaces eq. (1)-(2):
  it adds ``-gradient / W`` whatever the mode's weight, because counts add up where
  gradients are averaged. With the SGD rule and lr = W, asynchronous updates would come out
  right too (``-W x 1/W`` is -1 in float32), but a BSP round that closed without some
  worker (a lost worker, MLfabric-S's late update) would scale the others' deltas by W/m.

A delta MLfabric's scheduler drops (Alg. 2) is sent again with the worker's next one
(``keep_dropped_updates``). A delta dropped at a server (ps-async's delay bound, a scheduled
update that came too late) is lost: the global counts then disagree with the workers'
assignments. Every delta moves tokens between the topics of
one word, so each word's total count is conserved even so; a count that goes negative
(there, or transiently because the counts a worker holds are stale) is read as 0 by the
sampler, as asynchronous LDA samplers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .workloads import _mix

__all__ = [
    "AddCountDeltas", "Corpus", "GibbsSampler", "LdaModel", "LdaShard", "LdaSpec", "LdaTask", "SweepStats",
    "count_word_topics", "document_completion", "synthetic_corpus",
]

#: EM iterations of the held-out documents' topic mixtures (the metric moves by < 1e-3 nats
#: per token after 20 on the default corpus).
FOLD_IN_ITERATIONS = 30


@dataclass(frozen=True, kw_only=True)
class LdaSpec:
    """The corpus and the model: ``topics`` (K), ``vocabulary`` (V), ``documents`` for
    training (sharded across workers), ``held_out`` documents for the metric, the mean
    document length, and the Dirichlet priors ``alpha`` (document-topic) and ``beta``
    (topic-word), used both to draw the corpus and by the sampler."""

    topics: int = 20
    vocabulary: int = 4_000
    documents: int = 4_096
    held_out: int = 256
    doc_length: float = 100.0
    alpha: float = 0.1
    beta: float = 0.05

    def __post_init__(self) -> None:
        if self.topics < 2 or self.vocabulary < 2:
            raise ValueError(f"LDA needs at least 2 topics and 2 words, got topics={self.topics}, "
                             f"vocabulary={self.vocabulary}")
        if self.documents < 1 or self.held_out < 1:
            raise ValueError(f"LDA needs training and held-out documents, got documents={self.documents}, "
                             f"held_out={self.held_out}")
        if not (math.isfinite(self.doc_length) and self.doc_length >= 2):
            raise ValueError(f"doc_length (mean tokens per document) must be >= 2, got {self.doc_length}")
        if not (self.alpha > 0 and self.beta > 0 and math.isfinite(self.alpha) and math.isfinite(self.beta)):
            raise ValueError(f"the Dirichlet priors must be positive, got alpha={self.alpha}, beta={self.beta}")
        if self.vocabulary * self.topics >= 2 ** 31:
            raise ValueError(f"a {self.vocabulary} x {self.topics} word-topic matrix is too large")

    @property
    def train_samples(self) -> int:
        """What the training harness shards and batches: documents."""
        return self.documents


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """Documents as one token array: document ``d`` is ``words[offsets[d]:offsets[d + 1]]``."""

    words: np.ndarray    # int64 word ids, document after document
    offsets: np.ndarray  # int64, documents + 1 entries, offsets[0] = 0

    @property
    def documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def doc_of_token(self) -> np.ndarray:
        return np.repeat(np.arange(self.documents), self.lengths)

    def subset(self, docs: np.ndarray) -> "Corpus":
        """The documents ``docs`` (in that order) as a corpus of their own."""
        lengths = self.lengths[docs]
        starts = self.offsets[docs]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
        return Corpus(words=self.words[np.repeat(starts, lengths) + within], offsets=offsets)


@dataclass(frozen=True, kw_only=True)
class SyntheticCorpus:
    """What :func:`synthetic_corpus` draws: the training documents with their initial
    (uniformly random) topic assignments, the held-out documents split in halves, and the
    planted topics (K x V rows of ``phi``) and training documents' topics they came from."""

    train: Corpus
    initial_topics: np.ndarray   # int64, one per training token
    observed: Corpus             # first half of every held-out document
    held_out: Corpus             # second half
    phi: np.ndarray              # K x V, the planted topics
    planted_topics: np.ndarray   # int64, the topic each training token was drawn from


def synthetic_corpus(spec: LdaSpec, seed: int = 0) -> SyntheticCorpus:
    """Draw the corpus of ``spec`` from LDA's generative model (module docstring)."""
    rng = np.random.default_rng(_mix(seed, 40))
    phi = rng.dirichlet(np.full(spec.vocabulary, spec.beta), size=spec.topics)
    train, planted = _draw_documents(spec, phi, spec.documents, rng)
    test, _ = _draw_documents(spec, phi, spec.held_out, rng)
    initial = rng.integers(0, spec.topics, size=len(train.words))
    # Document completion: the first half of each held-out document is observed, the rest scored.
    lengths = test.lengths
    first = lengths // 2
    keep = np.arange(len(test.words)) - np.repeat(test.offsets[:-1], lengths) < np.repeat(first, lengths)
    observed = Corpus(words=test.words[keep], offsets=np.concatenate([[0], np.cumsum(first)]).astype(np.int64))
    rest = lengths - first
    held_out = Corpus(words=test.words[~keep], offsets=np.concatenate([[0], np.cumsum(rest)]).astype(np.int64))
    return SyntheticCorpus(train=train, initial_topics=initial, observed=observed, held_out=held_out, phi=phi,
                           planted_topics=planted)


def _draw_documents(spec: LdaSpec, phi: np.ndarray, count: int,
                    rng: np.random.Generator) -> tuple[Corpus, np.ndarray]:
    lengths = np.maximum(rng.poisson(spec.doc_length, size=count), 2)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    theta = rng.dirichlet(np.full(spec.topics, spec.alpha), size=count)
    doc = np.repeat(np.arange(count), lengths)
    topics = _categorical(np.cumsum(theta, axis=1)[doc], rng)
    words = np.empty(len(doc), dtype=np.int64)
    for k in range(spec.topics):  # one vectorized draw per topic
        where = np.flatnonzero(topics == k)
        words[where] = rng.choice(spec.vocabulary, size=len(where), p=phi[k])
    return Corpus(words=words, offsets=offsets), topics


def _categorical(cumulative: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row from rows of unnormalized cumulative weights (inverse CDF)."""
    u = rng.random(len(cumulative)) * cumulative[:, -1]
    return np.minimum((cumulative < u[:, None]).sum(axis=1), cumulative.shape[1] - 1)


def count_word_topics(words: np.ndarray, topics: np.ndarray, vocabulary: int, k: int) -> np.ndarray:
    """The V x K matrix of how many tokens of each word carry each topic (float64)."""
    flat = np.bincount(words * k + topics, minlength=vocabulary * k)
    return flat.reshape(vocabulary, k).astype(np.float64)


# --------------------------------------------------------------------------- the sampler


@dataclass(frozen=True)
class SweepStats:
    tokens: int            # tokens resampled
    changed: int           # of which changed topic
    log_likelihood: float  # sum over those tokens of log p(w | everything else), before resampling

    @property
    def per_token(self) -> float:
        return self.log_likelihood / self.tokens if self.tokens else math.nan


class GibbsSampler:
    """Collapsed Gibbs sampling of one worker's documents (module docstring): it owns the
    topic assignments ``z`` of its tokens and their document-topic counts; the word-topic
    counts are passed to every :meth:`sweep`, which changes them in place."""

    def __init__(self, corpus: Corpus, topics: np.ndarray, *, k: int, alpha: float, beta: float,
                 seed: int) -> None:
        if len(topics) != len(corpus.words):
            raise ValueError(f"{len(topics)} initial topics for {len(corpus.words)} tokens")
        self.corpus, self.k, self.alpha, self.beta = corpus, k, float(alpha), float(beta)
        self.z = np.asarray(topics, dtype=np.int64).copy()
        self.doc = corpus.doc_of_token
        self.position = np.arange(len(corpus.words)) - corpus.offsets[self.doc]
        self.doc_topic = np.zeros((corpus.documents, k))
        np.add.at(self.doc_topic, (self.doc, self.z), 1.0)
        self.rng = np.random.default_rng(seed)

    def sweep(self, word_topic: np.ndarray, docs: np.ndarray | None = None) -> SweepStats:
        """Resample every token of ``docs`` (indices into this sampler's corpus; default all)
        once, against and into ``word_topic`` (V x K float64, changed in place)."""
        if word_topic.dtype != np.float64 or word_topic.ndim != 2 or word_topic.shape[1] != self.k:
            raise ValueError(f"word_topic must be a V x {self.k} float64 array, got {word_topic.shape} "
                             f"{word_topic.dtype}")
        if docs is None:
            tokens = np.arange(len(self.z))
        else:
            chosen = np.zeros(self.corpus.documents, dtype=bool)
            chosen[np.asarray(docs, dtype=np.int64)] = True
            tokens = np.flatnonzero(chosen[self.doc])
        # Group the tokens by position in their document: a group holds one token per
        # document, so the document-topic counts stay exact within a group.
        tokens = tokens[np.argsort(self.position[tokens], kind="stable")]
        bounds = np.flatnonzero(np.diff(self.position[tokens])) + 1
        topic_total = word_topic.sum(axis=0)
        v_beta = word_topic.shape[0] * self.beta
        k_alpha = self.k * self.alpha
        lengths = self.corpus.lengths
        log_likelihood, changed = 0.0, 0
        for group in np.split(tokens, bounds):
            if len(group) == 0:
                continue
            w, d, old = self.corpus.words[group], self.doc[group], self.z[group]
            rows = np.arange(len(group))
            # Every count without the token itself; counts below 0 (stale or lost deltas) read as 0.
            nw = word_topic[w]
            nw[rows, old] -= 1
            np.maximum(nw, 0.0, out=nw)
            nd = self.doc_topic[d]
            nd[rows, old] -= 1
            weights = (nd + self.alpha) * (nw + self.beta) / (np.maximum(topic_total, 0.0) + v_beta)
            own = np.maximum(topic_total[old], 1.0)
            weights[rows, old] *= (own + v_beta) / (own - 1 + v_beta)
            cumulative = np.cumsum(weights, axis=1)
            # p(w | rest) = sum_k weights / (tokens of the document but this one + K alpha)
            log_likelihood += float(np.log(cumulative[:, -1]).sum() - np.log(lengths[d] - 1 + k_alpha).sum())
            new = _categorical(cumulative, self.rng)
            moved = new != old
            if not moved.any():
                continue
            w, d, old, new = w[moved], d[moved], old[moved], new[moved]
            np.subtract.at(word_topic, (w, old), 1.0)
            np.add.at(word_topic, (w, new), 1.0)
            self.doc_topic[d, old] -= 1  # one token per document in a group: no repeated index
            self.doc_topic[d, new] += 1
            topic_total -= np.bincount(old, minlength=self.k)
            topic_total += np.bincount(new, minlength=self.k)
            self.z[group[moved]] = new
            changed += len(new)
        return SweepStats(tokens=len(tokens), changed=changed, log_likelihood=log_likelihood)


def document_completion(word_topic: np.ndarray, observed: Corpus, held_out: Corpus, *, alpha: float, beta: float,
                        iterations: int = FOLD_IN_ITERATIONS) -> float:
    """Held-out log-likelihood per token (module docstring): ``observed`` and ``held_out``
    are the two halves of the same documents; ``word_topic`` may be fractional (an average
    of workers' copies) and is read clamped at 0."""
    if observed.documents != held_out.documents:
        raise ValueError(f"{observed.documents} observed halves for {held_out.documents} held-out ones")
    if np.any(observed.lengths == 0) or np.any(held_out.lengths == 0):
        raise ValueError("every held-out document needs at least one token in each half")
    counts = np.maximum(np.asarray(word_topic, dtype=np.float64), 0.0)
    v, k = counts.shape
    phi = (counts + beta) / (counts.sum(axis=0) + v * beta)  # V x K: p(word | topic)
    seen = phi[observed.words]
    starts = observed.offsets[:-1]
    theta = np.full((observed.documents, k), 1.0 / k)
    for _ in range(iterations):
        resp = theta[observed.doc_of_token] * seen
        resp /= resp.sum(axis=1, keepdims=True)
        theta = np.add.reduceat(resp, starts, axis=0) + alpha
        theta /= theta.sum(axis=1, keepdims=True)
    likelihood = (theta[held_out.doc_of_token] * phi[held_out.words]).sum(axis=1)
    return float(np.log(likelihood).mean())


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True, kw_only=True)
class LdaShard:
    """One worker's training documents and their initial topics (the harness's ``x``)."""

    corpus: Corpus
    initial_topics: np.ndarray
    worker: int
    workers: int


class AddCountDeltas:
    """The servers' (and replicas') rule for the LDA model: add the pushed count deltas.

    A pushed "gradient" is ``-W x`` a worker's delta (module docstring), or the sum of such
    gradients (a BSP round, an aggregate): the rule adds ``-gradient / W`` (exact: a sum of
    integers divisible by W), ignoring the mode's weight, because counts add up."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers

    def __call__(self, shard: torch.Tensor, gradient: torch.Tensor, info: Any) -> None:
        shard.sub_(gradient.to(shard.dtype).div(self.workers))


class LdaModel(nn.Module):
    """The word-topic counts as one parameter (``word_topic``, V x K float32) and, once it
    has seen a worker's shard, that worker's sampler. ``forward(batch)`` sweeps the batch's
    documents and returns the negative training log-likelihood per token, with a gradient
    of ``-W x`` the sweep's count delta (module docstring)."""

    def __init__(self, word_topic: torch.Tensor, *, alpha: float, beta: float, seed: int) -> None:
        super().__init__()
        self.word_topic = nn.Parameter(word_topic.to(torch.float32))
        self.alpha, self.beta, self.seed = alpha, beta, seed
        self.sampler: GibbsSampler | None = None
        self.shard: LdaShard | None = None

    def forward(self, batch: tuple[LdaShard, np.ndarray]) -> torch.Tensor:
        shard, docs = batch
        if self.sampler is None:
            self.shard = shard
            self.sampler = GibbsSampler(shard.corpus, shard.initial_topics, k=self.word_topic.shape[1],
                                        alpha=self.alpha, beta=self.beta, seed=_mix(self.seed, 41, shard.worker))
        elif shard is not self.shard:
            raise ValueError("an LdaModel samples one worker's shard: make a new model for another shard")
        before = self.word_topic.detach().numpy().astype(np.float64)
        counts = before.copy()
        stats = self.sampler.sweep(counts, docs)
        delta = torch.from_numpy((counts - before) * -shard.workers).to(torch.float32)
        surrogate = (self.word_topic * delta).sum()
        return torch.tensor(-stats.per_token, dtype=torch.float32) + surrogate - surrogate.detach()


class LdaTask:
    """The LDA workload of ``mlfabric train`` (module docstring): the harness's task
    interface (shard, val, batch, model, loss, evaluate), metric held-out log-likelihood."""

    metric = "log-likelihood"  # per held-out token, higher is better
    #: A delta MLfabric's scheduler drops goes out with the worker's next one (PSOptimizer's
    #: keep_dropped): every count change must reach the servers once.
    keep_dropped_updates = True

    def __init__(self, spec: LdaSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self._corpus: SyntheticCorpus | None = None

    def corpus(self) -> SyntheticCorpus:
        if self._corpus is None:
            self._corpus = synthetic_corpus(self.spec, self.seed)
        return self._corpus

    def shard(self, rank: int, world_size: int) -> tuple[LdaShard, torch.Tensor]:
        """Worker ``rank``'s documents ``rank, rank + W, ...`` and their local indices (the
        harness draws batches of documents from the latter)."""
        corpus = self.corpus()
        docs = np.arange(rank, self.spec.documents, world_size)
        if len(docs) == 0:
            raise ValueError(f"{self.spec.documents} documents leave worker {rank} of {world_size} without any; "
                             "raise --documents")
        mine = corpus.train.subset(docs)
        token_of = np.repeat(corpus.train.offsets[docs], mine.lengths) + (
            np.arange(len(mine.words)) - np.repeat(mine.offsets[:-1], mine.lengths))
        shard = LdaShard(corpus=mine, initial_topics=corpus.initial_topics[token_of], worker=rank,
                         workers=world_size)
        return shard, torch.arange(len(docs))

    def val(self) -> tuple[Corpus, Corpus]:
        corpus = self.corpus()
        return corpus.observed, corpus.held_out

    @staticmethod
    def batch(x: LdaShard, index: torch.Tensor) -> tuple[LdaShard, np.ndarray]:
        return x, index.numpy()

    @staticmethod
    def device_time(x: Any) -> float:
        return 0.0

    def initial_word_topic(self) -> np.ndarray:
        """The global counts of the initial assignments: every worker's, summed."""
        corpus = self.corpus()
        return count_word_topics(corpus.train.words, corpus.initial_topics, self.spec.vocabulary, self.spec.topics)

    def model(self) -> LdaModel:
        return LdaModel(torch.from_numpy(self.initial_word_topic()), alpha=self.spec.alpha, beta=self.spec.beta,
                        seed=self.seed)

    @staticmethod
    def loss(model: LdaModel, x: tuple[LdaShard, np.ndarray], y: torch.Tensor) -> torch.Tensor:
        return model(x)

    def evaluate(self, model: LdaModel, observed: Corpus, held_out: Corpus) -> tuple[float, float]:
        """(negative held-out log-likelihood per token, held-out log-likelihood per token)."""
        ll = document_completion(model.word_topic.detach().numpy(), observed, held_out, alpha=self.spec.alpha,
                                 beta=self.spec.beta)
        return -ll, ll

    @staticmethod
    def server_update_rule(workers: int) -> AddCountDeltas:
        return AddCountDeltas(workers)
