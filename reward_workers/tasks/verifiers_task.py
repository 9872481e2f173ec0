"""`task.name: verifiers:<taskset>`: an installed verifiers (0.4) taskset as a task: its
tasks are the rows, and its task class's rewards (`@vf.reward` methods and rewards plugged in
its config) score each response (docs/environments.md).

verifiers runs a task as an agent program (a harness) that calls a model over an
OpenAI-compatible endpoint. A single-turn taskset (no tools, no harness or Env of its own, no
container, rewards that need no runtime) is what its built-in chat program plays in one call:
groupflow samples that call itself, from the task's own system prompt and messages (few-shot
turns included), and scores the completion with the task's rewards on a trace holding that
one turn. A multi-turn taskset (one with a harness of its own) is played by that program, per
trajectory, against the trajectory's rollout endpoint (rollout/verifiers_harness.py, which the
job's `agent.harness` names): its row's answer carries the taskset's config and the task's
data for the program, and the response to score is the trace verifiers recorded, on which
the task's rewards run here. A multi-turn taskset needing what groupflow cannot give (a
container, the model's commands run on the host, tool servers, several agents, judges, a
runtime at scoring) is refused in one line saying which.

Rows: the taskset's config fields are the task's options (checked by the taskset's own
config model); `eval_taskset` holds the fields that differ for the held-out set (e.g. `{split:
test}`). Without it, a tenth of the taskset is held out by a hash of each task's key, as the
built-in generated tasks split theirs.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import random
from collections.abc import Iterator
from typing import Any

from groupflow.core.errors import first_line
from groupflow.core.records import Prompt, Verdict
from groupflow.reward_workers.tasks.base import copyable, is_held_out
from groupflow.reward_workers.tasks.tool_arithmetic import CHAT_TEMPLATE as BUILT_IN_CHAT_TEMPLATE

PACKAGE = "verifiers"
# The held-out search of an endless taskset reads at most this many tasks per prompt asked for.
HELD_OUT_DRAWS = 50
ENDPOINT_NOTE = (
    "groupflow plays a multi-turn taskset's own program, one agent per trajectory, through its "
    "OpenAI-compatible rollout endpoint, without containers, host commands, tool servers or "
    "judges (docs/environments.md)"
)
# The harness that plays a multi-turn taskset's trajectories (the job's agent.harness).
HARNESS = "groupflow.rollout.verifiers_harness:play_verifiers_task"


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError(
            "task.name: verifiers:... needs the verifiers package (pip install 'groupflow[envs]')"
        ) from None
    return vf


def _taskset_config_type(taskset: str) -> type:
    vf = _vf()
    try:
        return vf.taskset_config_type(taskset)
    except Exception as err:  # not installed, or not a taskset package: verifiers says which
        raise ValueError(
            f"task.name: verifiers:{taskset}: no verifiers taskset {taskset!r} "
            f"({first_line(err, 200)})"
        ) from None


@functools.cache
def declared_options(taskset: str) -> dict[str, inspect.Parameter]:
    """The taskset config's fields (its config model checks their values) and
    `eval_taskset`."""
    fields = [name for name in _taskset_config_type(taskset).model_fields if name != "id"]
    keyword = inspect.Parameter.KEYWORD_ONLY
    options = {name: inspect.Parameter(name, keyword, default=None) for name in fields}
    options["eval_taskset"] = inspect.Parameter(
        "eval_taskset", keyword, default=None, annotation=dict[str, Any] | None
    )
    return options


def multi_turn_reason(taskset: Any) -> str | None:
    """Why verifiers would play `taskset` in more than one model call (or in a runtime
    groupflow does not have), or None for a single-turn taskset."""
    from verifiers.v1.envs.single_agent import SingleAgentEnv
    from verifiers.v1.utils.loaders import default_harness_id, environment_class

    vf = _vf()
    taskset_id = taskset.config.id
    task_cls = type(taskset).task_type()
    if environment_class(taskset_id) is not SingleAgentEnv:
        return "it ships an Env of its own"
    if default_harness_id(taskset_id) != "bash":
        return "it ships a harness of its own"
    if taskset.toolsets(taskset.config) or task_cls.toolsets(taskset.config.task):
        return "it has tools"
    if task_cls.NEEDS_CONTAINER:
        return "its tasks need a container"
    if task_cls.setup is not vf.Task.setup or task_cls.finalize is not vf.Task.finalize:
        return "its tasks set up a runtime"
    if taskset.config.task.judges:
        return "its judges call a model"
    if _rewards_read_runtime(taskset):
        return "its rewards read a runtime"
    return None


def _rewards_read_runtime(taskset: Any) -> bool:
    first = next(iter(taskset.take(1)), None)
    return first is not None and any(
        "runtime" in inspect.signature(fn).parameters
        and inspect.signature(fn).parameters["runtime"].default is inspect.Parameter.empty
        for fn in first.hooks("reward")
    )


def unplayable_reason(taskset: Any) -> str | None:
    """Why groupflow cannot play multi-turn `taskset` through its endpoint (what it would
    need that groupflow does not give), or None when its program can run."""
    from verifiers.v1.envs.single_agent import SingleAgentEnv
    from verifiers.v1.utils.loaders import default_harness_id, environment_class, harness_class

    taskset_id = taskset.config.id
    task_cls = type(taskset).task_type()
    if environment_class(taskset_id) is not SingleAgentEnv:
        return "it ships an Env of its own"
    if task_cls.NEEDS_CONTAINER:
        return "its tasks need a container"
    if taskset.toolsets(taskset.config) or task_cls.toolsets(taskset.config.task):
        return "it has tools, served by verifiers' tool servers"
    if taskset.config.task.judges:
        return "its judges call a model"
    if _rewards_read_runtime(taskset):
        return "its rewards read a runtime"  # gone when the reward workers score the trace
    harness_id = default_harness_id(taskset_id)
    harness = harness_class(harness_id)
    if harness.NEEDS_CONTAINER:
        return f"its harness ({harness_id}) needs a container"
    if harness.EXECUTES_CODE:
        return f"its harness ({harness_id}) runs the model's commands on the host"
    return None


@functools.cache
def _plays_own_program(taskset: str, options_json: str) -> bool:
    fields = {k: v for k, v in json.loads(options_json).items() if k != "eval_taskset"}
    return VerifiersTask(taskset, **fields).multi_turn


def own_harness(taskset: str, options: dict[str, Any]) -> str | None:
    """The harness that plays `taskset`'s trajectories where it is multi-turn (its own
    program, rollout/verifiers_harness.py), else None; ValueError for one groupflow cannot
    play."""
    return HARNESS if _plays_own_program(taskset, json.dumps(options, sort_keys=True)) else None


class VerifiersTask:
    """The tasks of verifiers taskset `taskset`; the reward is their rewards' weighted mean."""

    # the built-in model's warm start copies the data's answer (once it copied the whole row)
    DEMONSTRATION_FORMAT = "the task data's answer"

    def __init__(self, taskset: str, eval_taskset: dict[str, Any] | None = None, **fields: Any):
        self.name = f"{PACKAGE}:{taskset}"
        self.config_type = _taskset_config_type(taskset)
        self.taskset = self._load(taskset, fields, "task.options")
        self.held_out = (
            None
            if eval_taskset is None
            else self._load(taskset, {**fields, **eval_taskset}, "task.options.eval_taskset")
        )
        self.multi_turn = multi_turn_reason(self.taskset) is not None
        if self.multi_turn:
            # the built-in model (groupflow/run/quickstart.py) is built with this task's chat
            # template, as tool_arithmetic's is: a program's turns need one, and it has none
            self.EXTRA_CHARACTERS = ""
            self.CHAT_TEMPLATE = BUILT_IN_CHAT_TEMPLATE
        if self.multi_turn and (why := unplayable_reason(self.taskset)) is not None:
            raise ValueError(
                f"task.name: {self.name} is a multi-turn taskset ({why}), which groupflow "
                f"cannot play: {ENDPOINT_NOTE}"
            )
        self.task_cls = type(self.taskset).task_type()
        first = next(iter(self.taskset.take(1)), None)
        if first is None or not (first.hooks("reward") or first.config.judges):
            raise ValueError(f"task.name: {self.name}: its tasks have no rewards to train on")
        self._train: list | None = None

    def _load(self, taskset: str, fields: dict[str, Any], where: str):
        vf = _vf()
        try:
            config = self.config_type.model_validate({**fields, "id": taskset})
        except Exception as err:  # pydantic's ValidationError: the first problem, in one line
            errors = getattr(err, "errors", lambda: [])()
            if errors:
                key = "".join(f".{part}" for part in errors[0]["loc"])
                raise ValueError(f"{where}{key}: {errors[0]['msg']}") from None
            raise ValueError(f"{where}: {first_line(err, 200)}") from None
        return vf.load_taskset(config)

    # ----- rows ---------------------------------------------------------------------------------
    def _prompt(self, task: Any, taskset: Any) -> Prompt:
        """A task's row; a multi-turn one's answer is what its program is played from (the
        taskset's config and the task's data), its text and messages the task's prompt."""
        from verifiers.v1.types import content_text

        data = task.data
        turns = (
            [{"role": "user", "content": data.prompt}]
            if isinstance(data.prompt, str)
            else [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]
        )
        if data.system_prompt is not None:
            turns.insert(0, {"role": "system", "content": data.system_prompt})
        only_text = isinstance(data.prompt, str) and data.system_prompt is None
        return Prompt(
            uid=task.key,
            text=data.prompt_text,
            answer=(
                {
                    "taskset": taskset.config.model_dump(mode="json"),
                    "data": data.model_dump(mode="json"),
                }
                if self.multi_turn
                else data.model_dump(mode="json")
            ),
            messages=None if only_text else turns,
        )

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """A finite taskset in a new order each pass (from `seed`); an endless one in its order."""
        keep = (lambda task: True) if self.held_out is not None else _not_held_out
        if not self.taskset.bounded:
            yield from (self._prompt(t, self.taskset) for t in self.taskset if keep(t))
            return
        if self._train is None:
            self._train = [t for t in self.taskset if keep(t)]
            if not self._train:
                raise ValueError(f"{self.name}: the taskset has no training tasks")
        rng = random.Random(seed)
        while True:
            order = list(self._train)
            rng.shuffle(order)
            yield from (self._prompt(t, self.taskset) for t in order)

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first n tasks of the held-out taskset, or the first n held-out tasks."""
        if self.held_out is not None:
            return [self._prompt(t, self.held_out) for t in self.held_out.take(n)]
        picked = []
        for i, task in enumerate(self.taskset):
            if len(picked) == n or (not self.taskset.bounded and i >= HELD_OUT_DRAWS * n):
                break
            if not _not_held_out(task):
                picked.append(self._prompt(task, self.taskset))
        return picked

    def demonstration(self, prompt: Prompt) -> str:
        """What the built-in model's warm start (groupflow/run/quickstart.py) answers a task
        with: its data's `answer`, the field in which verifiers' tasksets keep the gold."""
        data = prompt.answer["data"] if self.multi_turn else prompt.answer
        answer = data.get("answer")
        if not copyable(answer):
            raise ValueError(
                f"task.name: {self.name}: the built-in model (model.path unset) is "
                f"warm-started by copying each task's `answer`, which its tasks' data do not "
                f"hold as text; set model.path to a model of your own"
            )
        return str(answer)

    # ----- scoring ------------------------------------------------------------------------------
    def verify(self, prompt: Prompt, response: str) -> Verdict:
        """The task's rewards on a trace: of one turn (the prompt's messages and the
        response), or for a multi-turn taskset the one its program recorded (the response).
        Their weighted mean (verifiers' weighted sum over the sum of the weights) is the
        reward, clipped to [0, 1]; a reward that failed to run is a verifier error."""
        data = prompt.answer["data"] if self.multi_turn else prompt.answer
        task = self.task_cls(
            self.task_cls.data_type().model_validate(data), self.taskset.config.task
        )
        if self.multi_turn:
            try:
                trace = _vf().Trace.model_validate_json(response)
            except ValueError as err:
                return Verdict(
                    0.0,
                    f"{self.name}: the response is no verifiers trace: {first_line(err, 200)}",
                    error="error",
                )
        else:
            trace = self._trace(task, prompt, response)
        try:
            asyncio.run(task.score(trace))
        except Exception as err:
            return Verdict(
                0.0, f"{self.name} scoring raised: {first_line(err, 200)}", error="error"
            )
        rewards = trace.rewards
        if not rewards or any(r is None or not math.isfinite(r.score) for r in rewards.values()):
            return Verdict(0.0, f"{self.name} scored nothing: {rewards}", error="error")
        weights = sum(r.weight for r in rewards.values())
        total = sum(r.value for r in rewards.values())
        reward = min(1.0, max(0.0, total / weights if weights > 0 else total))
        parts = ", ".join(f"{name} {r.score:g}" for name, r in rewards.items())
        return Verdict(reward, f"{parts} -> {reward:g}"[:300])

    def _trace(self, task: Any, prompt: Prompt, response: str):
        vf = _vf()
        from verifiers.v1 import graph

        trace = vf.Trace(
            task=vf.TraceTask(
                type=self.task_cls.__name__, data=task.data, key=task.key, hash=task.hash
            ),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="groupflow", trainable=True),
        )
        by_role = {
            "system": vf.SystemMessage,
            "user": vf.UserMessage,
            "assistant": vf.AssistantMessage,
        }
        turns = prompt.messages or [{"role": "user", "content": prompt.text}]
        messages = [by_role[t["role"]](content=t["content"]) for t in turns]
        reply = vf.Response(
            id=prompt.uid,
            created=0,
            model="groupflow",
            message=vf.AssistantMessage(content=response),
            finish_reason="stop",
        )
        graph.prepare_turn(trace, messages).commit(reply)
        return trace

    def parse_answer(self, raw: Any) -> Any:
        raise ValueError(f"{self.name} reads no answers from files: its taskset holds them")


def _not_held_out(task: Any) -> bool:
    return not is_held_out(task.key)
