"""In-process fakes of the job loop's peers on a virtual clock, and `run_job`, a job over
them (groupflow.loop.job.TrainingJob), for the job loop's unit tests.

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

import torch

from groupflow.actors.generator import GeneratorPool
from groupflow.actors.starting import Replacements
from groupflow.core.peers import PeerDied, SyncHandles
from groupflow.core.records import Prompt, Response, SampledGroup, ScoredGroup, Verdict
from groupflow.core.recovery import LearnerLost, RestartBudget
from groupflow.core.scaling_protocol import PoolState
from groupflow.core.sync_probe import check_probe, compare_probe, probe_figures
from groupflow.core.weight_format import WeightSyncMismatch
from groupflow.learner.figures import RankFigures
from groupflow.loop.checkpoint import Checkpointing, CheckpointStore
from groupflow.loop.checkpointer import read_checkpoint
from groupflow.loop.job import TrainingJob
from groupflow.run.job_config import build_config

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
        assert len(set(map(id, handles))) == len(handles), "ray.wait needs distinct refs"
        assert handles or timeout is not None, "a wait on nothing, for ever"
        until = min((h.ready_at for h in handles), default=float("inf"))
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
            if h.value is FAILED:
                raise RuntimeError(h.label)
        return [h.value for h in handles]


DIED = object()  # the value of a call on an actor that died
FAILED = object()  # the value of a call that raised (the actor's own error)


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
        self.placed_at = 0.0  # when the cluster found a node for it
        self.start_error = ""  # what its constructor raises, if anything
        # up (its model loaded, sampled once) a second after it was placed
        self.warm_up = Remote(
            lambda group_size, sampling: FakeRef(
                self.placed_at + 1.0,
                {"": None, "dies": DIED}.get(self.start_error, FAILED),
                self.start_error or "engine up",
            )
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

    def submit(self, groups, chunk_id):
        kind = "score" if chunk_id >= 0 else "score held-out"
        self.log.append((kind, chunk_id, self.clock.now, [g.prompt.uid for g in groups]))
        scored = [
            ScoredGroup(g, [Verdict(self.reward(g.prompt, j), "") for j in range(len(g.responses))])
            for g in groups
        ]
        done = FakeRef(self.clock.now + self.score_s, scored, f"score {chunk_id}")
        self.batches.append((chunk_id, done))

    def in_flight(self):
        return [ref for _, ref in self.batches]

    def seconds_to_deadline(self):
        return None  # no batch is ever overdue

    def take(self, ready):
        taken = [(chunk_id, ref) for chunk_id, ref in self.batches if ref in ready]
        self.batches = [b for b in self.batches if b not in taken]
        return [(chunk_id, ref.value) for chunk_id, ref in taken]

    def scoring(self, chunk_id):
        return any(r == chunk_id for r, _ in self.batches)

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
        figures = RankFigures(grad_norms=[1.0, 1.0])  # two optimizer updates a step
        return [
            FakeRef(self.clock.now + self.seconds, figures, f"learn {step}")
            for r in range(self.num_ranks)
        ]

    def async_save_checkpoint(self, directory):
        Path(directory).mkdir()
        state = {"weights": self.weights, "moment": self.moment}
        for r in range(self.num_ranks):
            (Path(directory) / f"rank_{r}.json").write_text(json.dumps(state))
        # what a resume compares the adapter record with (groupflow/loop/checkpoint_adapters.py)
        shapes = {"param_shapes": [{"weight": torch.Size([1])}]}
        torch.save(shapes, Path(directory) / "zero_pp_rank_0_mp_rank_00_model_states.pt")
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
        self.probe_off_at = None  # the version whose loads' engines score the sync probe off
        self.checked: list[object] = []  # the values of the loads checked, in order
        self.forgotten = 0
        self.probed = []  # the sync probes compared since probe_figures

    def check_load(self, load, loaded) -> bool:
        self.checked.append(loaded)
        if loaded is not None and loaded == self.corrupt_at:
            raise WeightSyncMismatch(f"weight sync of policy version {loaded}: engine 0: x")
        if loaded is not None:
            # a probe of one sequence, scored 0.5 nats off at its second token where faulty
            off = 0.5 if loaded == self.probe_off_at else 0.0
            agreement = compare_probe([[5, 6, 7]], [[-1.0, -2.0 + off]], [[-1.0, -2.0]])
            self.probed.append(agreement)
            check_probe(agreement, "float32", "engine 0", loaded)
        return loaded is not None

    def probe_figures(self) -> dict[str, float]:
        probed, self.probed = self.probed, []
        return probe_figures(probed)

    def forget(self, load) -> None:
        self.forgotten += 1

    def async_sync(self, version, engines):
        if not self.loads:
            return SyncHandles([], [], [])
        now = engines[0].clock.now if engines else 0.0
        if version == self.rank_dies_at:
            self.rank_dies_at = None
            return SyncHandles(
                [FakeRef(now + 0.2, DIED, "dead rank in a sync")],
                [FakeRef(now + 0.1, None, "load of a broken stream") for _ in engines],
                list(engines),
            )
        pushes = []
        if self.learner_s:
            pushes = [FakeRef(now + self.learner_s, None, f"learner side of sync {version}")]
        receivers = [
            e
            for e in engines
            if not any(e is o and (i, version) in self.skip for i, o in enumerate(self.engines))
        ]
        return SyncHandles(pushes, [e.load(version) for e in receivers], receivers)


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


@dataclass(frozen=True)
class Faults:
    """What goes wrong in a job of `run_job`; nothing by default."""

    # the chunk each engine, then each replacement in its turn, dies in (0: never)
    engine_dies_at_chunk: tuple[int, ...] = ()
    engine_dies_at: str = ""  # the last engine: "load 2" dies loading version 2; "greedy"
    learner_dies_in_step: int = 0  # a rank dies in that step's training
    rank_dies_in_sync: int | None = None  # a rank dies in the sync of that version
    corrupt_sync_at: int | None = None  # that version's loads fail their checksum check
    probe_off_at: int | None = None  # that version's loads fail their sync probe
    skip_loads: frozenset = frozenset()  # (engine, version) loads that never happen
    loads: bool = True  # False: no engine ever loads a sync
    replacement_waits_s: float = 0.0  # a replacement waits this long for a node (pending)
    # how each replacement's start fails, in turn ("": it starts): "dies" dies from outside
    # (its node lost), any other text is its constructor's own error
    replacement_starts: tuple[str, ...] = ()


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
    run_dir: Path | None = None,
    resume=False,
    faults: Faults = Faults(),
    held_out_sets=(),
    engine_type=FakeEngine,
    starting=None,
    scaler=None,
    sync_s=0.0,
    task=None,
    stop=None,
) -> Run:
    """A job of `steps` steps; with run_dir, it checkpoints there, and with resume it goes
    on from the newest checkpoint, as a restarted driver with new peers would. `starting`
    stands in for Ray's StartingActors, `scaler(pool, rewards)` builds the job's Scaler and
    `stop(clock)` its StopRequest."""
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
    dies = list(faults.engine_dies_at_chunk) + [0] * engines
    fake_engines = [engine_type(clock, seconds_per_prompt, dies[i]) for i in range(engines)]
    fake_engines[-1].dies_at = faults.engine_dies_at
    learner = FakeLearner(clock, log, learn_s, faults.learner_dies_in_step)
    replacements = iter(dies[engines:])  # when each replacement dies in its turn
    replacement_starts = iter(faults.replacement_starts)
    started = []
    restarts = RestartBudget(cfg.trainer.max_restarts)

    def start_engine(slot):
        started.append(engine_type(clock, seconds_per_prompt, next(replacements, 0)))
        started[-1].placed_at = clock.now + faults.replacement_waits_s
        started[-1].start_error = next(replacement_starts, "")
        return started[-1]

    pool = GeneratorPool(
        fake_engines,
        futures,
        GROUP_SIZE,
        cfg.rollout.sampling,
        restarts,
        start_engine,
        starting,
        replacements=Replacements(
            "engine",
            lambda e: e.warm_up.remote(GROUP_SIZE, cfg.rollout.sampling),
            futures,
            {"CPU": 1.0},
            placed=lambda engine: engine.placed_at <= clock.now,
            cluster=lambda: ([{"CPU": 1.0}], {"CPU": 0.0}),
            end=lambda engine: None,
            clock=lambda: clock.now,
        ),
        clock=lambda: clock.now,
    )
    rewards = FakeRewards(clock, log, reward, score_s)
    transport = FakeTransport(
        fake_engines, faults.loads, faults.skip_loads, faults.rank_dies_in_sync, sync_s
    )
    transport.corrupt_at = faults.corrupt_sync_at
    transport.probe_off_at = faults.probe_off_at
    job = TrainingJob(
        cfg,
        task or CountingTask(),
        generators=pool,
        rewards=rewards,
        learner=learner,
        transport=transport,
        futures=futures,
        restarts=restarts,
        checkpointing=None
        if run_dir is None
        else Checkpointing(CheckpointStore(run_dir), MODEL_CONFIG, lambda path: None),
        held_out_sets=held_out_sets,
        scaler=None if scaler is None else scaler(pool, rewards),
        stop=None if stop is None else stop(clock),
        clock=lambda: clock.now,
    )
    if resume:
        newest = CheckpointStore(run_dir).newest()
        job.restore(newest, read_checkpoint(newest, MODEL_CONFIG, learner.num_ranks))
    else:
        job.evaluation.score_before()
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
