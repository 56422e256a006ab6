"""The LDA workload's pure parts: the synthetic corpus, the collapsed Gibbs sampler, the held-out
metric, the count deltas' exact arithmetic through allreduce's average and the servers' rule
(and the PS on threads), and the harness's handling of the log-likelihood metric.

    .venv/bin/python -m pytest tests/unit/test_lda.py -q
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout, local_jobs
from mlfabric.torch import PSOptimizer
from mlfabric.train.harness import CurvePoint, EagerTrainConfig, RunResult, target
from mlfabric.train.lda import (AddCountDeltas, GibbsSampler, LdaSpec, LdaTask, count_word_topics,
                                document_completion, synthetic_corpus)

TINY = LdaSpec(topics=4, vocabulary=60, documents=120, held_out=40, doc_length=30, alpha=0.1, beta=0.05)


def test_corpus_is_seeded_and_shards_partition_the_documents() -> None:
    a, b, other = synthetic_corpus(TINY, seed=3), synthetic_corpus(TINY, seed=3), synthetic_corpus(TINY, seed=4)
    assert np.array_equal(a.train.words, b.train.words) and np.array_equal(a.initial_topics, b.initial_topics)
    assert not np.array_equal(a.train.words[:200], other.train.words[:200])
    assert a.train.documents == 120 and a.observed.documents == a.held_out.documents == 40
    assert a.train.lengths.min() >= 2 and 0 <= a.train.words.min() and a.train.words.max() < TINY.vocabulary
    assert abs(a.train.lengths.mean() - 30) < 3  # Poisson(30)
    assert np.array_equal(a.observed.lengths, (a.observed.lengths + a.held_out.lengths) // 2)
    assert a.phi.shape == (4, 60) and np.allclose(a.phi.sum(axis=1), 1)
    task = LdaTask(TINY, seed=3)
    shards = [task.shard(w, 3)[0] for w in range(3)]
    assert [s.corpus.documents for s in shards] == [40, 40, 40] and all(s.workers == 3 for s in shards)
    # Worker w holds documents w, w + 3, ...: the same tokens and initial topics as the corpus.
    first = a.train.words[a.train.offsets[1]:a.train.offsets[2]]
    assert np.array_equal(shards[1].corpus.words[:len(first)], first)
    summed = sum(count_word_topics(s.corpus.words, s.initial_topics, 60, 4) for s in shards)
    assert np.array_equal(summed, task.initial_word_topic())


def test_sweeps_keep_every_count_equal_to_the_assignments() -> None:
    corpus = synthetic_corpus(TINY, seed=1)
    sampler = GibbsSampler(corpus.train, corpus.initial_topics, k=4, alpha=0.1, beta=0.05, seed=7)
    counts = count_word_topics(corpus.train.words, corpus.initial_topics, 60, 4)
    word_totals = counts.sum(axis=1)
    for docs in (None, np.arange(0, 120, 2), None):
        stats = sampler.sweep(counts, docs)
        assert stats.tokens == (len(corpus.train.words) if docs is None else corpus.train.lengths[docs].sum())
        assert 0 < stats.changed <= stats.tokens and stats.per_token < 0
    assert np.array_equal(counts, count_word_topics(corpus.train.words, sampler.z, 60, 4))
    expected_doc_topic = np.zeros((120, 4))
    np.add.at(expected_doc_topic, (corpus.train.doc_of_token, sampler.z), 1)
    assert np.array_equal(sampler.doc_topic, expected_doc_topic)
    assert np.array_equal(counts.sum(axis=1), word_totals)  # a sweep moves tokens between topics of a word
    with pytest.raises(ValueError, match="float64"):
        sampler.sweep(counts.astype(np.float32))


def test_sampler_recovers_planted_topics_and_the_held_out_likelihood_rises() -> None:
    spec = LdaSpec(topics=3, vocabulary=30, documents=150, held_out=50, doc_length=40, alpha=0.1, beta=0.05)
    corpus = synthetic_corpus(spec, seed=0)
    sampler = GibbsSampler(corpus.train, corpus.initial_topics, k=3, alpha=spec.alpha, beta=spec.beta, seed=1)
    counts = count_word_topics(corpus.train.words, corpus.initial_topics, 30, 3)

    def held_out(c: np.ndarray) -> float:
        return document_completion(c, corpus.observed, corpus.held_out, alpha=spec.alpha, beta=spec.beta)

    curve = [held_out(counts)]
    for _ in range(30):
        sampler.sweep(counts)
        curve.append(held_out(counts))
    planted = held_out(count_word_topics(corpus.train.words, corpus.planted_topics, 30, 3))
    assert curve[-1] > curve[0] + 0.3, curve
    assert curve[-1] > planted - 0.05, (curve[-1], planted)
    learned = (counts / counts.sum(axis=0)).T  # K x V
    # Up to a permutation, every learned topic is close to a planted one (total variation).
    distance = min(max(0.5 * np.abs(learned[list(p)] - corpus.phi).sum(axis=1))
                   for p in itertools.permutations(range(3)))
    assert distance < 0.1, distance
    # The assignments agree with the planted topics for most tokens (best permutation).
    agreement = max(np.mean(np.array(p)[sampler.z] == corpus.planted_topics) for p in itertools.permutations(range(3)))
    assert agreement > 0.85, agreement


def test_document_completion_scores_the_right_topics_higher() -> None:
    corpus = synthetic_corpus(TINY, seed=2)
    planted = count_word_topics(corpus.train.words, corpus.planted_topics, 60, 4)
    flat = np.ones_like(planted)
    score = lambda c: document_completion(c, corpus.observed, corpus.held_out, alpha=0.1, beta=0.05)  # noqa: E731
    assert score(planted) > score(flat) + 0.5
    assert score(flat) == pytest.approx(-np.log(60), abs=1e-9)  # uniform topics: every word 1/V
    with pytest.raises(ValueError, match="observed halves"):
        document_completion(planted, corpus.observed, corpus.train, alpha=0.1, beta=0.05)


@pytest.mark.parametrize("workers", [3, 7])
def test_allreduce_average_and_server_rule_add_the_deltas_exactly(workers: int) -> None:
    """The model's gradient is -W x the sweep's delta: allreduce's average (sum, then divide
    by W) and an SGD step with lr 1 add the sum of the deltas; the servers' rule does too,
    whatever weight a mode gives (a BSP round missing a worker included)."""
    task = LdaTask(TINY, seed=5)
    start = torch.from_numpy(task.initial_word_topic()).float()
    grads, deltas = [], []
    for w in range(workers):
        model = task.model()
        shard, index = task.shard(w, workers)
        model(task.batch(shard, index)).backward()
        counts = model.word_topic.detach().numpy().astype(np.float64).copy()
        counts += -model.word_topic.grad.numpy() / workers
        deltas.append(counts - start.numpy())
        assert np.array_equal(np.round(deltas[-1]), deltas[-1]) and np.abs(deltas[-1]).sum() > 0
        grads.append(model.word_topic.grad.clone())
    expected = start.double() + torch.from_numpy(sum(deltas))
    averaged = torch.stack(grads).sum(0).div_(workers)  # mlfabric's allreduce "avg"
    param = torch.nn.Parameter(start.clone())
    param.grad = averaged
    torch.optim.SGD([param], lr=1.0, momentum=0.0).step()
    assert torch.equal(param.detach().double(), expected)
    shard = start.clone()
    rule = AddCountDeltas(workers)
    for g in grads[:-1]:
        rule(shard, g, None)
    rule(shard, grads[-1], None)
    assert torch.equal(shard.double(), expected)
    partial = start.clone()  # a BSP round of 2 of the W gradients: the sum of those 2 deltas
    rule(partial, grads[0] + grads[1], None)
    assert torch.equal(partial.double(), start.double() + torch.from_numpy(deltas[0] + deltas[1]))


@pytest.mark.parametrize("consistency", ["async", "bsp"])
def test_parameter_server_counts_match_every_workers_assignments(consistency: str) -> None:
    """3 workers sweep through PSOptimizer on threads: with no update dropped, the server's
    counts are exactly the counts of all workers' final assignments, integers >= 0."""
    workers, steps = 3, 4
    task = LdaTask(TINY, seed=6)
    layout = PSLayout(servers=2, workers=workers)
    jobs = local_jobs(layout, PSConfig(consistency=consistency, timeout_s=20))
    finals: dict[int, np.ndarray] = {}
    assignments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    errors: list[BaseException] = []
    models = {job.rank: task.model() for job in jobs}  # built here: torch's generator is shared by threads

    def work(job) -> None:  # noqa: ANN001
        try:
            if job.role == "server":
                job.server.register_update_callback(task.server_update_rule(workers), "model")
                job.serve()
                shard = job.server.shards["model"]
                finals[job.rank] = shard.values.numpy().copy()
                return
            model = models[job.rank]
            ps = PSOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, job.worker)
            shard, index = task.shard(job.worker.index, workers)
            for step in range(steps):
                ps.zero_grad()
                model(task.batch(shard, index[step % 2::2])).backward()
                ps.step()
            assignments[job.rank] = (shard.corpus.words, model.sampler.z.copy())
            ps.leave()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    server = np.concatenate([finals[r] for r in sorted(finals)]).astype(np.float64).reshape(TINY.vocabulary, -1)
    truth = sum(count_word_topics(words, z, TINY.vocabulary, TINY.topics) for words, z in assignments.values())
    assert np.array_equal(server, truth)
    assert server.min() >= 0 and np.array_equal(server.sum(axis=1), task.initial_word_topic().sum(axis=1))


def test_config_refuses_what_would_scale_the_deltas() -> None:
    for workers in (3, 8):  # by default a step sweeps the worker's whole shard
        assert EagerTrainConfig(workload="lda", workers=workers, modes=("allreduce",)).steps_per_epoch == 1
    with pytest.raises(ValueError, match="lr must be 1 and momentum 0"):
        EagerTrainConfig(workload="lda", workers=2, lr=0.5)
    with pytest.raises(ValueError, match="lr must be 1 and momentum 0"):
        EagerTrainConfig(workload="lda", workers=2, momentum=0.9)
    with pytest.raises(ValueError, match="cannot run eager-solo"):
        EagerTrainConfig(workload="lda", workers=2, modes=("allreduce", "eager-solo"))
    with pytest.raises(ValueError, match="must be positive"):
        LdaSpec(alpha=0.0)


def _run(metric: str, values: list[float]) -> RunResult:
    curve = tuple(CurvePoint(epoch=i + 1, step=2 * (i + 1), wall_s=float(i + 1), train_loss=0.0, val_loss=0.0,
                             val_metric=v, val_metric_rank0=v) for i, v in enumerate(values))
    return RunResult(inject="none", mode="allreduce", metric=metric, steps=2 * len(values), loop_s=float(len(values)),
                     per_rank_loop_s=(1.0,), curve=curve, final_val_loss=0.0, final_metric=values[-1],
                     mean_active=None, contributed_fraction=None, rounds_skipped=None, injected_s=0.0,
                     samples_per_step=1)


def test_log_likelihood_is_higher_is_better_with_a_one_percent_target() -> None:
    run = _run("log-likelihood", [-8.0, -7.5, -7.06, -7.0])
    assert target(run) == pytest.approx(-7.07)
    assert run.time_to(-7.07) == 3.0 and run.steps_to(-7.07) == 6
    assert run.steps_to(-6.9) is None and run.time_to(-6.9) is None
    mse = _run("mse", [4.0, 2.0, 1.0])
    assert mse.steps_to(2.0) == 4 and target(mse) == pytest.approx(1.05)
