"""The job loop (groupflow.job.TrainingJob) over in-process fakes on a virtual clock.

The generator pool is the real one (actors/generator.py: chunking, least outstanding work)
over fake engines; the reward pool, learner and transport are fakes. A fake handle is ready at
a virtual time; waiting advances the clock to the earliest one, as a cluster would. An engine
runs its calls one after another, so a chunk or a weight load waits for the calls sent before.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import pytest

from groupflow.actors.generator import GeneratorPool
from groupflow.catalogue import BY_KEY
from groupflow.config import build_config
from groupflow.job import MAX_REFILLS, TrainingJob
from groupflow.records import Prompt, Response, SampledGroup, ScoredGroup, Verdict

PROMPTS_PER_STEP = 8
GROUP_SIZE = 2


class Clock:
    now = 0.0


@dataclass(eq=False)
class FakeRef:
    ready_at: float
    value: object
    label: str


class FakeFutures:
    def __init__(self, clock: Clock, log: list):
        self.clock, self.log = clock, log

    def wait_any(self, handles):
        handles = list(handles)
        assert handles and len(set(map(id, handles))) == len(handles), (
            "ray.wait needs distinct refs"
        )
        self.clock.now = max(self.clock.now, min(h.ready_at for h in handles))
        return [h for h in handles if h.ready_at <= self.clock.now]

    def get(self, handles):
        for h in handles:
            self.clock.now = max(self.clock.now, h.ready_at)
            self.log.append(("get", h.label, self.clock.now))
        return [h.value for h in handles]


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeEngine:
    """Takes `seconds_per_prompt` per prompt; samples with the version it last loaded."""

    def __init__(self, clock: Clock, seconds_per_prompt: float):
        self.clock, self.seconds_per_prompt = clock, seconds_per_prompt
        self.version, self.free_at, self.prompts_sampled = 0, 0.0, 0
        self.sample = Remote(self._sample)
        self.greedy = Remote(self._greedy)

    def _run(self, seconds: float) -> float:
        self.free_at = max(self.clock.now, self.free_at) + seconds
        return self.free_at

    def _sample(self, prompts, group_size, sampling):
        groups = [
            SampledGroup(
                p,
                [int(p.uid)],  # the prompt's index leads each training sequence
                [Response([3, j], f"{p.uid}/{j}", [-0.5, -0.5]) for j in range(group_size)],
                self.version,
            )
            for p in prompts
        ]
        self.prompts_sampled += len(prompts)
        done = self._run(self.seconds_per_prompt * len(prompts))
        return FakeRef(done, groups, f"chunk of {[p.uid for p in prompts]}")

    def _greedy(self, prompts, max_tokens):
        return FakeRef(self._run(0.0), [str(p.answer) for p in prompts], "greedy")

    def load(self, version: int) -> FakeRef:
        # Every later call on this engine runs after the load: it sees the new version.
        self.version = version
        return FakeRef(self._run(0.1), version, "load")


class FakeRewards:
    num_workers, errors, timeouts = 1, 0, 0

    def __init__(self, clock: Clock, log: list, reward):
        self.clock, self.log, self.reward = clock, log, reward
        self.scored: dict[int, list[ScoredGroup]] = defaultdict(list)

    def submit(self, groups, rollout_id):
        self.log.append(("score", rollout_id, self.clock.now, [g.prompt.uid for g in groups]))
        self.scored[rollout_id] += [
            ScoredGroup(g, [Verdict(self.reward(g.prompt, j), "") for j in range(len(g.responses))])
            for g in groups
        ]

    def drain(self, rollout_id):
        return self.scored.pop(rollout_id, [])

    def pending_groups(self):
        return sum(map(len, self.scored.values()))


class FakeLearner:
    num_ranks = 2

    def __init__(self, clock: Clock, log: list, seconds: float):
        self.clock, self.log, self.seconds = clock, log, seconds
        self.steps: list[list] = []  # the sequences of each step

    def async_train_step(self, sequences):
        self.steps.append(sequences)
        step = len(self.steps)
        self.log.append(("train", step, self.clock.now))
        return [
            FakeRef(self.clock.now + self.seconds, {"rank": r, "step": step}, f"learn {step}")
            for r in range(self.num_ranks)
        ]


class FakeTransport:
    def __init__(self, engines: list[FakeEngine], loads: bool = True):
        self.engines, self.loads = engines, loads

    def async_sync(self, version):
        return [e.load(version) for e in self.engines] if self.loads else []


class CountingTask:
    """Prompt i has uid "i"; answers are checked by the fake reward pool, not here."""

    def train_prompts(self, seed):
        return (Prompt(str(i), f"q{i}", i) for i in itertools.count())

    def eval_prompts(self, n):
        return [Prompt(f"e{i}", f"e{i}", i) for i in range(n)]

    def verify(self, prompt, response):
        return Verdict(float(response == str(prompt.answer)), "")


class Sink:
    def __init__(self):
        self.records: list[dict] = []

    def write(self, record):
        self.records.append(record)


def varied(prompt, j):
    return float(j % 2)


@dataclass
class Run:
    job: TrainingJob
    records: list[dict]
    learner: FakeLearner
    log: list
    engines: list[FakeEngine]


def run_job(
    steps=4,
    staleness=0,
    *,
    reward=varied,
    learn_s=1.0,
    seconds_per_prompt=1.0,
    engines=2,
    overrides=(),
    loads=True,
) -> Run:
    cfg = build_config(
        {},
        [
            f"trainer.steps={steps}",
            f"rollout.num_engines={engines}",
            f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
            f"rollout.group_size={GROUP_SIZE}",
            "task.eval_size=4",
            *overrides,
        ],
    )
    # Beyond the config's cap on purpose: the loop's queue holds any k.
    cfg.trainer = cfg.trainer.model_copy(update={"max_staleness": staleness})
    clock, log = Clock(), []
    futures = FakeFutures(clock, log)
    fake_engines = [FakeEngine(clock, seconds_per_prompt) for _ in range(engines)]
    learner = FakeLearner(clock, log, learn_s)
    job = TrainingJob(
        cfg,
        CountingTask(),
        generators=GeneratorPool(fake_engines, futures, GROUP_SIZE, cfg.rollout.sampling),
        rewards=FakeRewards(clock, log, reward),
        learner=learner,
        transport=FakeTransport(fake_engines, loads),
        futures=futures,
        learner_figures=lambda results: {"optimizer_updates": len(results)},
    )
    sink = Sink()
    job.train([sink])
    return Run(job, sink.records, learner, log, fake_engines)


def trained_prompts(run: Run) -> list[list[int]]:
    """The prompts (by index) of each learner step; a sequence starts with its prompt's index."""
    return [sorted({s.input_ids[0] for s in seqs}) for seqs in run.learner.steps]


def scored_at(run: Run) -> list[tuple[int, float]]:
    """(rollout id, virtual time) of each batch handed to the reward pool."""
    return [(e[1], e[2]) for e in run.log if e[0] == "score"]


def step_prompts(first: int, count: int = PROMPTS_PER_STEP) -> list[int]:
    return list(range(first, first + count))


# ----- staleness --------------------------------------------------------------------------------
def test_staleness_zero_trains_each_step_on_its_own_fresh_samples():
    run = run_job(steps=4, staleness=0)
    assert [r["staleness_max"] for r in run.records] == [0, 0, 0, 0]
    for step, seqs in enumerate(run.learner.steps):
        assert {s.policy_version for s in seqs} == {step}
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(4)]


def test_staleness_one_is_exactly_one_version_behind_after_the_first_step():
    run = run_job(steps=5, staleness=1)
    assert [r["staleness_max"] for r in run.records] == [0, 1, 1, 1, 1]
    assert [r["staleness_mean"] for r in run.records] == [0, 1, 1, 1, 1]
    assert [r["policy_version"] for r in run.records] == [1, 2, 3, 4, 5]
    # every prompt trained once, in order, and nothing generated past the last step
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(5)]
    assert {uid for _, _, _, uids in (e for e in run.log if e[0] == "score") for uid in uids} == {
        str(i) for i in range(40)
    }


@pytest.mark.parametrize("k", [2, 3])
def test_max_staleness_is_a_queue_of_k_rollouts(k):
    run = run_job(steps=6, staleness=k)
    assert [r["staleness_max"] for r in run.records] == [min(s, k) for s in range(6)]
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(6)]


def test_a_sample_older_than_max_staleness_is_never_trained_on():
    # Engines that never load new weights: step 3 would train on version 0 samples at
    # version 2, two versions behind.
    with pytest.raises(RuntimeError, match="trainer.max_staleness=1"):
        run_job(steps=4, staleness=1, loads=False)


# ----- streaming --------------------------------------------------------------------------------
def test_chunks_reach_the_reward_pool_as_each_finishes():
    run = run_job(steps=1, staleness=0, engines=2, seconds_per_prompt=1.0)
    # 8 prompts, 2 engines: 4 chunks of 2, two per engine, finishing at t=2 and t=4 on each
    assert scored_at(run) == [(0, 2.0), (0, 2.0), (0, 4.0), (0, 4.0)]
    scored = [uids for e in run.log if e[0] == "score" for uids in [e[3]]]
    assert sorted(int(u) for uids in scored for u in uids) == step_prompts(0)
    assert [e.prompts_sampled for e in run.engines] == [4, 4]  # least outstanding work


def test_scoring_overlaps_learning():
    """A chunk of step 2 is scored while step 1 learns, before its result is collected."""
    run = run_job(steps=2, staleness=1, learn_s=100.0, seconds_per_prompt=1.0)
    learn_1 = next(i for i, e in enumerate(run.log) if e[:2] == ("get", "learn 1"))
    learning_ends = run.log[learn_1][2]
    step_2_scores = [i for i, e in enumerate(run.log) if e[0] == "score" and e[1] == 1]
    assert step_2_scores and all(i < learn_1 for i in step_2_scores)
    assert all(t < learning_ends for rollout, t in scored_at(run) if rollout == 1)


# ----- dynamic sampling -------------------------------------------------------------------------
def odd_prompts_vary(prompt, j):
    """Even prompts are all wrong (a flat group, no signal); odd prompts split their group."""
    return float(int(prompt.uid) % 2 and j % 2)


def test_dynamic_sampling_refills_flat_groups_from_new_prompts():
    run = run_job(steps=1, reward=odd_prompts_vary, overrides=["algorithm.dynamic_sampling=true"])
    # The first rollout has 4 informative groups; one more rollout brings 4 more.
    (prompts,) = trained_prompts(run)
    assert prompts == [1, 3, 5, 7, 9, 11, 13, 15]
    assert run.records[0]["num_groups"] == PROMPTS_PER_STEP


def test_dynamic_sampling_gives_up_after_its_refills():
    run = run_job(steps=1, reward=lambda p, j: 0.0, overrides=["algorithm.dynamic_sampling=true"])
    # No group ever varies: the step trains on the first rollout after MAX_REFILLS draws.
    assert trained_prompts(run) == [step_prompts(0)]
    scored = {int(u) for e in run.log if e[0] == "score" for u in e[3]}
    assert scored == set(range(PROMPTS_PER_STEP * (1 + MAX_REFILLS)))


# ----- the record -------------------------------------------------------------------------------
def test_every_key_of_the_step_record_is_in_the_catalogue():
    run = run_job(steps=2, staleness=1, overrides=["trainer.eval_every=1"])
    for record in run.records:
        assert set(record) <= BY_KEY.keys(), set(record) - BY_KEY.keys()
    assert "eval_accuracy" in run.records[0] and "eval_accuracy" not in run.records[1]
    assert run.records[0]["optimizer_updates"] == 2  # the learner's results reached its figures
    assert run.records[0]["num_sequences"] == PROMPTS_PER_STEP * GROUP_SIZE
