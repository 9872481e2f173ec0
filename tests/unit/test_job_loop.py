"""The job loop (groupflow.job.TrainingJob) over in-process fakes on a virtual clock.

The generator pool is the real one (actors/generator.py: chunking, least outstanding work)
over fake engines; the reward pool, learner and transport are fakes. A fake handle is ready at
a virtual time; waiting advances the clock to the earliest one, as a cluster would. An engine
runs its calls one after another, so a chunk or a weight load waits for the calls sent before.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from groupflow.actors.generator import CHUNKS_PER_ENGINE, GeneratorPool
from groupflow.catalogue import BY_KEY
from groupflow.checkpoint import Checkpointing, CheckpointStore, read_checkpoint
from groupflow.config import build_config
from groupflow.held_out import EVAL_ROLLOUT
from groupflow.job import TrainingJob
from groupflow.peers import PeerDied, SyncHandles
from groupflow.prompt_stream import MAX_REFILLS
from groupflow.records import Prompt, Response, SampledGroup, ScoredGroup, Verdict
from groupflow.recovery import LearnerLost, RestartBudget
from groupflow.scaling import PoolState
from groupflow.weight_format import WeightSyncMismatch

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

    def wait_any(self, handles, timeout=None):
        handles = list(handles)
        assert handles and len(set(map(id, handles))) == len(handles), (
            "ray.wait needs distinct refs"
        )
        until = min(h.ready_at for h in handles)
        if timeout is not None:
            until = min(until, self.clock.now + timeout)
        self.clock.now = max(self.clock.now, until)
        return [h for h in handles if h.ready_at <= self.clock.now]

    def get(self, handles):
        for h in handles:
            self.clock.now = max(self.clock.now, h.ready_at)
            self.log.append(("get", h.label, self.clock.now))
            if h.value is DIED:
                raise PeerDied(h.label)
        return [h.value for h in handles]


DIED = object()  # the value of a call on an actor that died


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeEngine:
    """Takes `seconds_per_prompt` per prompt; samples with the version it last loaded."""

    def __init__(self, clock: Clock, seconds_per_prompt: float, dies_at_chunk: int = 0):
        self.clock, self.seconds_per_prompt = clock, seconds_per_prompt
        self.version, self.free_at, self.prompts_sampled = 0, 0.0, 0
        self.chunks, self.dies_at_chunk, self.dead = 0, dies_at_chunk, False
        self.dies_at = ""  # "load 2": dies loading version 2; "greedy": in an evaluation
        self.queued_at_load: list[float] = []  # seconds of work ahead of each weight load
        self.sample = Remote(self._sample)
        self.complete = Remote(self._complete)
        self.__ray_ready__ = Remote(
            lambda: FakeRef(self.clock.now, DIED if self.dead else 1, "ping")
        )

    def _run(self, seconds: float) -> float:
        self.free_at = max(self.clock.now, self.free_at) + seconds
        return self.free_at

    def _sample(self, prompts, group_size, sampling, min_version=0):
        self.chunks += 1
        if self.dead or self.chunks == self.dies_at_chunk:  # killed in the middle of it
            self.dead = True
            return FakeRef(self._run(0.5 * self.seconds_per_prompt), DIED, "died")
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

    def _complete(self, prompts, n, sampling, greedy, min_version=0):
        if self.dies_at == "greedy":
            self.dead = True
        if self.dead:
            return FakeRef(self._run(0.1), DIED, "evaluation on a dead engine")
        groups = [
            SampledGroup(
                p, [1], [Response([4], str(p.answer), [-0.1])] * (1 if greedy else n), self.version
            )
            for p in prompts
        ]
        return FakeRef(self._run(0.0), groups, "evaluation")

    def load(self, version: int) -> FakeRef:
        if self.dies_at == f"load {version}":
            self.dead = True
        if self.dead:
            return FakeRef(self.clock.now, DIED, "load on a dead engine")
        # Every later call on this engine runs after the load: it sees the new version.
        self.queued_at_load.append(max(0.0, self.free_at - self.clock.now))
        self.version = version
        return FakeRef(self._run(0.1), version, "load")


class FakeRewards:
    """Scores each batch in `score_s` (batches in parallel)."""

    num_workers, errors, timeouts = 1, 0, 0

    def __init__(self, clock: Clock, log: list, reward, score_s: float = 0.0):
        self.clock, self.log, self.reward, self.score_s = clock, log, reward, score_s
        self.batches: list[tuple[int, FakeRef]] = []  # (rollout id, handle) being scored

    def submit(self, groups, rollout_id):
        kind = "score" if rollout_id >= 0 else "score held-out"
        self.log.append((kind, rollout_id, self.clock.now, [g.prompt.uid for g in groups]))
        scored = [
            ScoredGroup(g, [Verdict(self.reward(g.prompt, j), "") for j in range(len(g.responses))])
            for g in groups
        ]
        done = FakeRef(self.clock.now + self.score_s, scored, f"score {rollout_id}")
        self.batches.append((rollout_id, done))

    def in_flight(self):
        return [ref for _, ref in self.batches]

    def seconds_to_deadline(self):
        return None  # no batch is ever overdue

    def take(self, ready):
        taken = [(rollout_id, ref) for rollout_id, ref in self.batches if ref in ready]
        self.batches = [b for b in self.batches if b not in taken]
        return [(rollout_id, ref.value) for rollout_id, ref in taken]

    def scoring(self, rollout_id):
        return any(r == rollout_id for r, _ in self.batches)

    def pending_groups(self):
        return sum(len(ref.value) for _, ref in self.batches)

    def scale_to(self, target):  # a fake pool's workers come and go at once
        self.num_workers = target

    def settle(self):
        return self.state()

    def state(self):
        return PoolState(self.num_workers, self.num_workers)


class FakeLearner:
    """Its "weights" and "optimizer state" are numbers that depend on the order of the steps
    and on what each step trains (not on the order within a step, which the engines' timing
    sets); a checkpoint is a file of them per rank."""

    num_ranks = 2

    def __init__(self, clock: Clock, log: list, seconds: float, dies_in_step: int = 0):
        self.clock, self.log, self.seconds = clock, log, seconds
        self.steps: list[list] = []  # the sequences of each step (since this learner started)
        self.weights, self.moment = 0.0, 0.0
        self.dies_in_step, self.restarts = dies_in_step, 0

    def async_train_step(self, sequences, lr=None):
        if len(self.steps) + 1 == self.dies_in_step:
            self.dies_in_step = 0  # rank 1 dies; rank 0 would wait for it forever
            return [FakeRef(1e9, {}, "hung rank 0"), FakeRef(self.clock.now + 0.5, DIED, "dead")]
        self.steps.append(sequences)
        step = len(self.steps)
        self.log.append(("train", step, self.clock.now))
        update = sum(sorted(s.input_ids[0] * (1 + s.advantage) for s in sequences))
        self.moment = 0.5 * self.moment + update
        self.weights = 0.9 * self.weights + self.moment
        return [
            FakeRef(self.clock.now + self.seconds, {"rank": r, "step": step}, f"learn {step}")
            for r in range(self.num_ranks)
        ]

    def async_save_checkpoint(self, directory):
        Path(directory).mkdir()
        state = {"weights": self.weights, "moment": self.moment}
        for r in range(self.num_ranks):
            (Path(directory) / f"rank_{r}.json").write_text(json.dumps(state))
        return [FakeRef(self.clock.now + 5.0, None, "save")]

    def load_checkpoint(self, directory):
        state = json.loads((Path(directory) / "rank_0.json").read_text())
        self.weights, self.moment = state["weights"], state["moment"]

    def restart(self):
        self.weights, self.moment, self.restarts = 0.0, 0.0, self.restarts + 1
        self.steps.append("restarted")


class FakeTransport:
    """`skip`: (engine, version) loads that never happen (the engine keeps its weights);
    `rank_dies_at`: the version whose sync a learner rank dies in: the engines abandon their
    loads of it (as an engine does a broken stream's), before the learner's side fails;
    `learner_s`: seconds the learner's side of a sync takes (its ranks' pushes)."""

    def __init__(
        self,
        engines: list[FakeEngine],
        loads: bool = True,
        skip=frozenset(),
        rank_dies_at=None,
        learner_s: float = 0.0,
    ):
        self.engines, self.loads, self.skip, self.rank_dies_at = engines, loads, skip, rank_dies_at
        self.learner_s = learner_s
        self.corrupt_at = None  # the version whose loads fail their checksum check
        self.checked: list[object] = []  # the values of the loads checked, in order
        self.forgotten = 0

    def check_load(self, load, loaded) -> bool:
        self.checked.append(loaded)
        if loaded is not None and loaded == self.corrupt_at:
            raise WeightSyncMismatch(f"weight sync of policy version {loaded}: engine 0: x")
        return loaded is not None

    def forget(self, load) -> None:
        self.forgotten += 1

    def async_sync(self, version, engines=None):
        if not self.loads:
            return SyncHandles([], [])
        targets = self.engines if engines is None else engines
        if version == self.rank_dies_at:
            self.rank_dies_at = None
            now = self.engines[0].clock.now
            return SyncHandles(
                [FakeRef(now + 0.2, DIED, "dead rank in a sync")],
                [FakeRef(now + 0.1, None, "load of a broken stream") for _ in targets],
            )
        pushes = []
        if self.learner_s:
            now = self.engines[0].clock.now
            pushes = [FakeRef(now + self.learner_s, None, f"learner side of sync {version}")]
        return SyncHandles(
            pushes,
            [
                e.load(version)
                for i, e in enumerate(self.engines)
                if (i, version) not in self.skip and any(e is t for t in targets)
            ],
        )


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
    clock: Clock
    started: list[FakeEngine]  # engines started after the job began (replacements, scale-ups)


def run_job(
    steps=4,
    staleness=0,
    *,
    reward=varied,
    learn_s=1.0,
    seconds_per_prompt=1.0,
    score_s=0.0,
    engines=2,
    overrides=(),
    loads=True,
    skip_loads=frozenset(),
    run_dir: Path | None = None,
    resume=False,
    engine_dies_at_chunk=(),
    engine_dies_at="",
    learner_dies_in_step=0,
    rank_dies_in_sync=None,
    held_out_sets=(),
    engine_type=FakeEngine,
    starting=None,
    scaler=None,
    corrupt_sync_at=None,
    sync_s=0.0,
) -> Run:
    """A job of `steps` steps; with run_dir, it checkpoints there, and with resume it goes
    on from the newest checkpoint, as a restarted driver with new peers would. `starting`
    stands in for Ray's StartingActors, and `scaler(pool, rewards)` builds the job's Scaler."""
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
    dies = list(engine_dies_at_chunk) + [0] * engines
    fake_engines = [engine_type(clock, seconds_per_prompt, dies[i]) for i in range(engines)]
    fake_engines[-1].dies_at = engine_dies_at
    learner = FakeLearner(clock, log, learn_s, learner_dies_in_step)
    replacements = iter(dies[engines:])  # when each replacement dies in its turn
    started = []
    restarts = RestartBudget(cfg.trainer.max_restarts)

    def start_engine(slot):
        started.append(engine_type(clock, seconds_per_prompt, next(replacements, 0)))
        return started[-1]

    pool = GeneratorPool(
        fake_engines,
        futures,
        GROUP_SIZE,
        cfg.rollout.sampling,
        restarts,
        start_engine,
        starting,
        clock=lambda: clock.now,
    )
    rewards = FakeRewards(clock, log, reward, score_s)
    transport = FakeTransport(fake_engines, loads, skip_loads, rank_dies_in_sync, sync_s)
    transport.corrupt_at = corrupt_sync_at
    job = TrainingJob(
        cfg,
        CountingTask(),
        generators=pool,
        rewards=rewards,
        learner=learner,
        transport=transport,
        futures=futures,
        restarts=restarts,
        learner_figures=lambda results: {"optimizer_updates": len(results)},
        checkpointing=None
        if run_dir is None
        else Checkpointing(CheckpointStore(run_dir), MODEL_CONFIG, lambda path: None),
        held_out_sets=held_out_sets,
        scaler=None if scaler is None else scaler(pool, rewards),
    )
    if resume:
        newest = CheckpointStore(run_dir).newest()
        job.restore(newest, read_checkpoint(newest, MODEL_CONFIG, learner.num_ranks))
    else:
        job.warm_accuracy = job.evaluate()["eval_accuracy"]
    sink = Sink()
    try:
        job.train([sink])
    except LearnerLost:  # what the driver does: the ranks rebuilt from the newest checkpoint
        newest = CheckpointStore(run_dir).newest()
        job.recover_learner(newest, read_checkpoint(newest, MODEL_CONFIG, learner.num_ranks))
        job.train([sink])
    return Run(job, sink.records, learner, log, fake_engines, clock, started)


MODEL_CONFIG = {"model_type": "qwen2", "hidden_size": 8}


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


@pytest.mark.parametrize("k", [2, 4, 8])
def test_a_slow_learner_trains_samples_exactly_max_staleness_old(k):
    """Learner-bound (100 s a step against 4 s of generation): the engines run k steps ahead,
    so the lag grows to k and stays there, never beyond; the learner never waits after the
    first step, and every prompt is trained once, in order."""
    run = run_job(steps=k + 3, staleness=k, learn_s=100.0)
    assert [r["staleness_max"] for r in run.records] == [min(s, k) for s in range(k + 3)]
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(k + 3)]
    first_rollout = PROMPTS_PER_STEP * 1.0 / 2  # seconds, on 2 engines
    assert run.clock.now <= first_rollout + (k + 3) * 100.0 + 1e-9
    assert all(r["groups_dropped_stale"] == 0 for r in run.records)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_engines_never_wait_for_the_learner_when_generation_is_the_bottleneck(k):
    """Generation-bound (4 s of generation a step on 2 engines, 1 s of learning): the engines
    are busy from the first chunk to the last, but for the weight loads (0.1 s each)."""
    steps = 8
    run = run_job(steps=steps, staleness=k, learn_s=1.0, seconds_per_prompt=1.0)
    generation = steps * PROMPTS_PER_STEP * 1.0 / 2  # per engine
    loads = (steps - 1) * 0.1
    last_step_learns = 1.0
    assert run.clock.now <= generation + loads + last_step_learns + 1e-9
    assert all(r["staleness_max"] <= k for r in run.records)
    # idle only while the last step learns: nothing is left to draw
    assert [r["time_engines_idle_s"] for r in run.records] == [0.0] * (steps - 1) + [1.0]


@pytest.mark.parametrize("k", [1, 2])
def test_slow_scoring_holds_up_no_engine(k):
    """Each batch takes 3 s to score, longer than a chunk takes to generate (2 s): while the
    loop waits for a chunk's scores, finished chunks still go to the reward pool and engines
    with room get their next chunks (a wait on the reward pool alone would leave them idle),
    so the engines idle only in the last step, with nothing left to draw."""
    steps = 8
    run = run_job(steps=steps, staleness=k, learn_s=1.0, seconds_per_prompt=1.0, score_s=3.0)
    idle = [r["time_engines_idle_s"] for r in run.records]
    assert idle[:-1] == [0.0] * (steps - 1), idle
    assert all(r["time_reward_s"] > 0 for r in run.records)  # the scores were waited for
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(steps)]


@pytest.mark.parametrize("k", [1, 2])
def test_a_slow_learner_side_sync_holds_up_no_engine(k):
    """The learner's side of each weight sync takes 2 s (a large model into the object
    store), learning 0.5 s, generation 4 s a step: while the loop waits for the sync, finished
    chunks still go to the reward pool and engines with room get their next chunks, so the
    engines idle only in the last step, with nothing left to draw."""
    steps = 8
    run = run_job(steps=steps, staleness=k, learn_s=0.5, seconds_per_prompt=1.0, sync_s=2.0)
    idle = [r["time_engines_idle_s"] for r in run.records]
    assert idle[:-1] == [0.0] * (steps - 1), idle
    generation, loads = steps * PROMPTS_PER_STEP * 1.0 / 2, (steps - 1) * 0.1  # per engine
    assert run.clock.now <= generation + loads + 0.5 + 2.0 + 1e-9  # + the last learn and sync
    synced = {e[1] for e in run.log if e[0] == "get" and e[1].startswith("learner side")}
    assert synced == {f"learner side of sync {v}" for v in range(1, steps + 1)}
    assert trained_prompts(run) == [step_prompts(8 * s) for s in range(steps)]


def test_at_staleness_zero_the_engines_wait_while_the_learner_trains():
    run = run_job(steps=3, staleness=0, learn_s=5.0)
    assert [r["time_engines_idle_s"] for r in run.records] == pytest.approx([5.0] * 3)


def test_weight_loads_wait_behind_at_most_chunks_per_engine():
    """A load sent to a busy engine that finishes its requests first (these fakes do, as with
    rollout.partial_rollout false) waits behind the few chunks it holds, not behind every
    prompt drawn ahead: CHUNKS_PER_ENGINE chunks of 2 prompts (1 s each)."""
    run = run_job(steps=8, staleness=8, learn_s=3.0, seconds_per_prompt=1.0)
    waits = [w for engine in run.engines for w in engine.queued_at_load]
    assert waits and max(waits) <= CHUNKS_PER_ENGINE * 2 * 1.0 + 1e-9


def test_a_sample_older_than_max_staleness_is_dropped_and_counted():
    # Engine 1 misses its load of version 1: its chunks of step 3 come from version 0, two
    # versions behind the learner.
    run = run_job(steps=5, staleness=1, skip_loads={(1, 1)}, learn_s=4.0)
    assert sum(r["groups_dropped_stale"] for r in run.records) > 0
    assert all(r["staleness_max"] <= 1 for r in run.records)
    assert all(r["num_groups"] == PROMPTS_PER_STEP for r in run.records)


def test_engines_that_never_load_stop_the_job():
    with pytest.raises(RuntimeError, match="trainer.max_staleness=1"):
        run_job(steps=4, staleness=1, loads=False)


# ----- streaming --------------------------------------------------------------------------------
def test_chunks_reach_the_reward_pool_as_each_finishes():
    run = run_job(steps=1, staleness=0, engines=2, seconds_per_prompt=1.0)
    # 8 prompts, 2 engines: 4 chunks of 2, two per engine, finishing at t=2 and t=4 on each
    assert sorted(scored_at(run)) == [(0, 2.0), (1, 2.0), (2, 4.0), (3, 4.0)]
    scored = [uids for e in run.log if e[0] == "score" for uids in [e[3]]]
    assert sorted(int(u) for uids in scored for u in uids) == step_prompts(0)
    assert [e.prompts_sampled for e in run.engines] == [4, 4]  # least outstanding work


def test_scoring_overlaps_learning():
    """A chunk of step 2 is scored while step 1 learns, before its result is collected."""
    run = run_job(steps=2, staleness=1, learn_s=100.0, seconds_per_prompt=1.0)
    learn_1 = next(i for i, e in enumerate(run.log) if e[:2] == ("get", "learn 1"))
    learning_ends = run.log[learn_1][2]
    # step 1's prompts are chunks 0-3, step 2's chunks 4-7
    step_2_scores = [i for i, e in enumerate(run.log) if e[0] == "score" and e[1] >= 4]
    assert step_2_scores and all(i < learn_1 for i in step_2_scores)
    assert all(t < learning_ends for chunk, t in scored_at(run) if chunk >= 4)


# ----- dynamic sampling -------------------------------------------------------------------------
def odd_prompts_vary(prompt, j):
    """Even prompts are all wrong (a flat group, no signal); odd prompts split their group
    (held-out prompts, "e<i>", are all right)."""
    if not prompt.uid.isdigit():
        return 1.0
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


# ----- checkpoints and resume -------------------------------------------------------------------
@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_resumed_job_trains_what_the_straight_one_does(tmp_path, staleness, dynamic):
    """6 steps straight against a job that dies after step 5 (its newest checkpoint is step
    4's, saved while step 5's rollout was in flight) and a resume to step 6: the same
    prompts in the same order and the same learner state."""
    opts = dict(staleness=staleness, reward=odd_prompts_vary if dynamic else varied)
    overrides = ["trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]
    if dynamic:
        overrides.append("algorithm.dynamic_sampling=true")
    straight = run_job(steps=6, run_dir=tmp_path / "straight", overrides=overrides, **opts)
    first = run_job(steps=5, run_dir=tmp_path / "cut", overrides=overrides, **opts)
    resumed = run_job(steps=6, run_dir=tmp_path / "cut", overrides=overrides, resume=True, **opts)

    assert trained_prompts(first)[:4] + trained_prompts(resumed) == trained_prompts(straight)
    assert (resumed.learner.weights, resumed.learner.moment) == (
        straight.learner.weights,
        straight.learner.moment,
    )
    assert [r["step"] for r in resumed.records] == [5, 6]
    assert [r["policy_version"] for r in resumed.records] == [5, 6]
    # only the newest checkpoint is kept
    assert [p.name for p in CheckpointStore(tmp_path / "cut").complete()] == ["step_6"]


def test_checkpoint_figures_are_in_the_records(tmp_path):
    run = run_job(steps=3, run_dir=tmp_path, overrides=["trainer.checkpoint_every=1"])
    assert "checkpoint_seconds" not in run.records[0]  # no save yet when step 1 is recorded
    assert all(r["checkpoint_seconds"] > 0 for r in run.records[1:])
    assert all(r["seconds_since_checkpoint"] >= 0 for r in run.records)
    for record in run.records:
        assert set(record) <= BY_KEY.keys(), set(record) - BY_KEY.keys()


def test_the_save_overlaps_the_next_rollout(tmp_path):
    """On-policy, the next step's rollout is launched before the ranks save, so the engines
    generate while the shards are written."""
    run = run_job(steps=2, run_dir=tmp_path, overrides=["trainer.checkpoint_every=1"])
    step_2_scores = [e[2] for e in run.log if e[0] == "score" and e[1] == 1]
    save_done = next(e[2] for e in run.log if e[:2] == ("get", "save"))
    assert step_2_scores and min(step_2_scores) < save_done


# ----- recovery ---------------------------------------------------------------------------------
def scored_prompts(run: Run) -> list[int]:
    return sorted(int(u) for e in run.log if e[0] == "score" for u in e[3])


@pytest.mark.parametrize(
    "engines, staleness, dies_at",
    [
        (1, 0, 1),  # the one engine dies in its first chunk, its second queued behind it
        (1, 0, 2),  # ... in its second chunk
        (2, 0, 2),  # engine 0 dies in step 2's rollout
        (2, 1, 2),  # ... while step 1 learns
        (2, 1, 3),
    ],
)
def test_a_dead_engine_is_replaced_and_its_chunks_generated_again(engines, staleness, dies_at):
    run = run_job(steps=4, staleness=staleness, engines=engines, engine_dies_at_chunk=(dies_at,))
    straight = run_job(steps=4, staleness=staleness, engines=engines)
    assert trained_prompts(run) == trained_prompts(straight)
    assert scored_prompts(run) == scored_prompts(straight)  # no group lost or scored twice
    for step, seqs in enumerate(run.learner.steps):
        # the replacement sampled with the current weights, never the base model's (a chunk
        # sent again after a weight sync samples from the newer version)
        assert {s.policy_version for s in seqs} <= set(range(max(0, step - staleness), step + 1))
        if staleness == 0:
            assert {s.policy_version for s in seqs} == {step}
    assert [r["engine_restarts"] for r in run.records][-1] == 1
    assert not run.engines[0].dead and run.engines[0].version == 4
    # only the replacement was sent the weights it awaited: the survivor loads each version once
    survivors = run.engines[1:], straight.engines[1:]
    assert [len(e.queued_at_load) for e in survivors[0]] == [
        len(e.queued_at_load) for e in survivors[1]
    ]


@pytest.mark.parametrize("dies_at", ["load 2", "greedy"])
def test_an_engine_dying_in_a_weight_sync_or_an_evaluation_is_replaced(dies_at):
    overrides = ["trainer.eval_every=2"]
    run = run_job(steps=4, engine_dies_at=dies_at, overrides=overrides)
    straight = run_job(steps=4, overrides=overrides)
    assert trained_prompts(run) == trained_prompts(straight)
    assert run.records[-1]["engine_restarts"] == 1
    assert run.records[1]["eval_accuracy"] == straight.records[1]["eval_accuracy"]
    assert [e.version for e in run.engines] == [4, 4]


def test_engines_dying_in_a_row_end_the_job_after_max_restarts():
    with pytest.raises(RuntimeError, match=r"trainer.max_restarts=1"):
        # the engine and each replacement die in their first chunk
        run_job(
            steps=2, engines=1, engine_dies_at_chunk=(1, 1, 1), overrides=["trainer.max_restarts=1"]
        )


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("dies_in", ["step 4", "the sync after step 3"])
def test_a_dead_learner_rank_rebuilds_the_learner_from_the_newest_checkpoint(
    tmp_path, staleness, dies_in
):
    overrides = ["trainer.checkpoint_every=2"]
    straight = run_job(steps=5, staleness=staleness, run_dir=tmp_path / "a", overrides=overrides)
    in_step = dies_in == "step 4"
    run = run_job(
        steps=5,
        staleness=staleness,
        run_dir=tmp_path / "b",
        overrides=overrides,
        learner_dies_in_step=4 if in_step else 0,
        rank_dies_in_sync=None if in_step else 3,  # every engine's load of it fails too
        engine_dies_at_chunk=(2,),  # and an engine in step 1: counted once over the rebuild
    )
    # steps 1-3 trained, a rank died, the ranks came back at step 2's checkpoint and trained
    # 3-5 again on the same prompts
    assert run.learner.restarts == 1
    died = run.learner.steps.index("restarted")
    assert died == 3
    again = [sorted({s.input_ids[0] for s in seqs}) for seqs in run.learner.steps[died + 1 :]]
    assert again == trained_prompts(straight)[2:]
    assert (run.learner.weights, run.learner.moment) == (
        straight.learner.weights,
        straight.learner.moment,
    )
    assert [e.version for e in run.job.generators.engines] == [5, 5], "the last version"
    # the driver rewinds the file to step 2; step 3 has a record only if its sync ended
    steps = [1, 2, 3, 3, 4, 5] if in_step else [1, 2, 3, 4, 5]
    assert [r["step"] for r in run.records] == steps
    assert [r["learner_restarts"] for r in run.records] == [0] * (len(steps) - 3) + [1] * 3
    assert [r["engine_restarts"] for r in run.records] == [1] * len(steps)


# ----- verified weight syncs -------------------------------------------------------------------
@pytest.mark.parametrize("staleness", [0, 2])
def test_every_finished_load_is_checked_and_the_records_count_the_verified_ones(staleness):
    run = run_job(steps=5, staleness=staleness, engines=2)
    checked = run.job.pipeline.transport.checked
    # each engine's loads of versions 1-4 finished while the job ran (the last sync's may not)
    assert sorted(v for v in checked if v is not None)[: 2 * 4] == sorted([1, 2, 3, 4] * 2)
    assert sum(r["weight_sync_verified"] for r in run.records) == len(checked) > 0


def test_an_abandoned_load_is_checked_but_not_counted_as_verified(tmp_path):
    run = run_job(
        steps=4,
        run_dir=tmp_path,
        overrides=["trainer.checkpoint_every=1"],
        rank_dies_in_sync=2,  # the engines abandon their loads of version 2
    )
    checked = run.job.pipeline.transport.checked
    assert checked.count(None) == 2
    verified = sum(r["weight_sync_verified"] for r in run.records)
    assert 0 < verified <= len(checked) - 2


def test_a_load_that_fails_its_check_stops_the_job():
    with pytest.raises(WeightSyncMismatch, match="policy version 2"):
        run_job(steps=4, staleness=1, corrupt_sync_at=2)


def test_a_load_on_an_engine_that_died_is_forgotten_not_checked():
    run = run_job(steps=3, engine_dies_at="load 2")
    assert run.job.pipeline.transport.forgotten == 1
    assert 2 not in [v for v in run.job.pipeline.transport.checked if v is not None][:1]


def test_held_out_scores_greedy_and_sampled_through_the_reward_pool():
    overrides = ["trainer.eval_every=2", "trainer.eval_samples=4", "trainer.eval_pass_k=2"]
    run = run_job(steps=3, reward=varied, overrides=overrides)
    record = run.records[1]
    # varied: answer j of a group gets j % 2, so greedy answers (j = 0) all fail, and each
    # prompt's 4 samples pass twice: mean@4 = 1/2, pass@2 = 1 - C(2,2)/C(4,2) = 5/6
    assert record["eval_accuracy"] == 0.0
    assert record["eval_mean_at_n"] == pytest.approx(0.5)
    assert record["eval_pass_at_k"] == pytest.approx(5 / 6)
    held_out = [e for e in run.log if e[0] == "score held-out"]
    # before training and at step 2: greedy, then sampled
    assert len(held_out) == 4 and all(e[1] == EVAL_ROLLOUT for e in held_out)
    assert "eval_mean_at_n" not in run.records[0]


class FakeHeldOutSet:
    """A held-out set of another task: its own prompts and scorer."""

    def __init__(self, name: str, size: int):
        self.name = name
        self.prompts = [Prompt(f"{name}{i}", f"{name} {i}", i) for i in range(size)]
        self.scored: list[list] = []

    def rewards(self, groups):
        self.scored.append([g.prompt.uid for g in groups])
        return [[float(g.prompt.answer % 2 == 0)] * len(g.responses) for g in groups]


def test_extra_held_out_sets_are_scored_by_their_own_scorer_and_reported_by_name():
    sets = [FakeHeldOutSet("even", 4), FakeHeldOutSet("more", 5)]
    run = run_job(steps=2, overrides=["trainer.eval_every=1"], held_out_sets=sets)
    record = run.records[0]
    # answers of prompt i score 1 when i is even: 2 of 4, 3 of 5
    assert record["eval_set_accuracy"] == {"even": 0.5, "more": 0.6}
    assert "eval_set_mean_at_n" not in record
    assert sets[0].scored[0] == ["even0", "even1", "even2", "even3"]
