"""Multi-turn trajectories on the real stack: token identity on a real vLLM engine under
several chat templates, and a job of the tool task whose python tool runs hostile code."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap
import uuid
from pathlib import Path

import pytest
import ray
from transformers import AutoTokenizer

from groupflow.actors.generator import start_generator_pool
from groupflow.actors.tools import ToolPoolClient, start_tool_pool
from groupflow.config import SamplingConfig
from groupflow.observe.catalogue import BY_KEY
from groupflow.reward_workers.tasks import make_task
from groupflow.run.cli import main
from groupflow.run.job_config import build_config, small_model_config
from tests.integration.plugins.environments import MARKER
from tests.integration.prometheus_server import PrometheusServer
from tests.integration.ray_nodes import free_port
from tests.unit.test_trajectory import FORGETFUL, TAGGED
from tests.unit.test_verifiers_multi_turn import EXPORTS as TWO_TURNS_EXPORTS
from tests.unit.test_verifiers_multi_turn import TWO_TURNS

pytestmark = pytest.mark.integration

PLUGINS = Path(__file__).parent / "plugins" / "environments.py"
REWARD_PLUGINS = Path(__file__).parent / "plugins" / "rewards.py"
HARNESSES = Path(__file__).parent / "plugins" / "harnesses.py"
GROUP = 3


def _record_requests(generator) -> None:
    """Inside the actor: keep every vLLM request's prompt ids and the ids it generated."""
    engine = generator.engine
    engine.recorded = []
    request = engine._request

    async def recording(ids, params):
        out, version = await request(ids, params)
        engine.recorded.append((tuple(ids), tuple(out.outputs[0].token_ids)))
        return out, version

    engine._request = recording


def _use_template(generator, path: str | None) -> None:
    """Inside the actor: render prompts and observations with another chat template."""
    from groupflow.rollout.prompt_render import ChatSettings, PromptRenderer

    engine = generator.engine
    chat = engine.agent.chat(ChatSettings(chat_template=path or "auto"))
    engine.renderer = PromptRenderer(engine.tokenizer, chat)
    engine.agent.start(engine.renderer)
    engine.recorded.clear()


def _recorded(generator) -> set:
    return set(generator.engine.recorded)


@pytest.fixture(scope="module")
def engine(ray_cluster, tool_model):
    env = f"{PLUGINS}:EchoTwice"
    cfg = small_model_config({"task": {"name": "tool_arithmetic"}, "agent": {"environment": env}})
    pool = start_generator_pool(cfg, tool_model)
    ray.get(pool.engines[0].__ray_call__.remote(_record_requests))
    yield pool.engines[0]
    pool.shutdown()


@pytest.mark.parametrize("template", ["own", "tagged", "forgetful"])
def test_trained_ids_are_what_the_engine_generated_and_was_given(engine, template, tmp_path):
    path = None
    if template != "own":
        path = tmp_path / f"{template}.jinja"
        path.write_text({"tagged": TAGGED, "forgetful": FORGETFUL}[template])
    ray.get(engine.__ray_call__.remote(_use_template, None if path is None else str(path)))
    prompts = make_task("tool_arithmetic").eval_prompts(3)
    sampling = SamplingConfig(max_tokens=24, seed=5)
    groups = ray.get(engine.sample.remote(prompts, GROUP, sampling))
    recorded = ray.get(engine.__ray_call__.remote(_recorded))
    checked, turns = 0, []
    for group in groups:
        for response in group.responses:
            # three turns, or fewer where a turn ran to its limit (the echo answers any text)
            assert response.end_reason in ("answer", "token_limit")
            assert response.end_reason == "token_limit" or response.turns == 3
            turns.append(response.turns)
            mask = response.loss_mask
            assert len(mask) == len(response.token_ids) and sum(mask) > 0
            # a turn's end-of-text token is no part of the text the verifier scores (the
            # hermes parser has turns decoded with special tokens: all others are kept)
            assert "<eos>" not in response.text
            assert len(response.logprobs) == sum(mask)
            # every run of model tokens is one request: sampled on exactly the ids before it
            starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
            for start in starts:
                end = start
                while end < len(mask) and mask[end]:
                    end += 1
                given = tuple(group.prompt_ids + response.token_ids[:start])
                assert (given, tuple(response.token_ids[start:end])) in recorded
                checked += 1
    assert checked == sum(turns) and turns.count(3) >= len(turns) // 2


def _use_harness(generator, spec: str | None) -> None:
    """Inside the actor: the engine's trajectories run by a harness through its endpoint."""
    from groupflow.rollout.agent import user_harness

    generator.engine.agent.harness = None if spec is None else user_harness(spec)
    generator.engine.recorded.clear()


def _endpoint_refusals(generator) -> dict:
    return dict(generator.engine._endpoint.refused)


def _through_harness(engine, harness: str, prompts, max_tokens: int) -> tuple[list, set]:
    """The engine's groups of `prompts` played by `harness` through its endpoint, which
    refused no call, and the requests the engine ran for them."""
    ray.get(engine.__ray_call__.remote(_use_harness, harness))
    try:
        sampling = SamplingConfig(max_tokens=max_tokens, seed=5)
        groups = ray.get(engine.sample.remote(prompts, GROUP, sampling))
        recorded = ray.get(engine.__ray_call__.remote(_recorded))
        refused = ray.get(engine.__ray_call__.remote(_endpoint_refusals))
    finally:
        ray.get(engine.__ray_call__.remote(_use_harness, None))
    assert refused == {}
    return groups, recorded


@pytest.mark.parametrize("harness", ["three_tool_calls", "rewrites_earlier_turns"])
def test_a_harness_trains_on_exactly_what_the_engine_sampled_through_the_endpoint(engine, harness):
    """A harness of the real openai SDK, through the engine's endpoint (rides on the engine
    above): three calls, each trained sequence's model tokens sampled on exactly the ids
    before them; a harness that rewrites its history splits into such sequences."""
    prompts = make_task("tool_arithmetic").eval_prompts(2)
    groups, recorded = _through_harness(engine, f"{HARNESSES}:{harness}", prompts, 16)
    splits = {"three_tool_calls": 0, "rewrites_earlier_turns": 2}[harness]
    for group in groups:
        for response in group.responses:
            assert (response.end_reason, response.infra_failure) == ("answer", None)
            assert response.turns == 3 and len(response.earlier) == splits
            assert _sampled_runs(response, recorded) == 3  # every call, trained once, exactly


def _sampled_runs(response, recorded: set) -> int:
    """The runs of model tokens in a harness trajectory's trained sequences (the response and
    the sequences it split off), each checked to be one engine request: sampled on exactly
    the ids before it."""
    runs = 0
    for part in (*response.earlier, response):
        assert part.prompt_ids and len(part.logprobs) == sum(part.loss_mask)
        mask, ids = part.loss_mask, part.token_ids
        for start in range(len(mask)):
            if mask[start] and (start == 0 or not mask[start - 1]):
                end = start
                while end < len(mask) and mask[end]:
                    end += 1
                given = tuple(part.prompt_ids + ids[:start])
                assert (given, tuple(ids[start:end])) in recorded
                runs += 1
    return runs


def _import_from(generator, folder: str) -> None:
    """Inside the actor: modules in `folder` importable, as a user's installed package is."""
    import sys

    if folder not in sys.path:
        sys.path.insert(0, folder)


def test_a_verifiers_taskset_plays_its_own_program_through_the_endpoint(
    engine, tmp_path, monkeypatch
):
    """A multi-turn verifiers taskset (docs/environments.md) as its job plays it: the job's
    agent.harness is verifiers' own program, which calls the engine's endpoint through the
    openai SDK (rides on the engine above). What trains is what the engine sampled, each call
    once; the task's own rewards score the trace verifiers recorded of both turns."""
    name = f"doubles_{uuid.uuid4().hex[:8]}"
    source = textwrap.dedent(TWO_TURNS) + f"\n__all__ = {TWO_TURNS_EXPORTS}\n"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    task_spec = {"name": f"verifiers:{name}", "options": {"count": 6}}
    harness = build_config({"task": task_spec}).agent.harness
    task = make_task(task_spec["name"], task_spec["options"])
    rows = [row for row, _ in zip(task.train_prompts(0), range(2), strict=False)]
    ray.get(engine.__ray_call__.remote(_import_from, str(tmp_path)))
    groups, recorded = _through_harness(engine, harness, rows, 8)
    rewards = []
    for row, group in zip(rows, groups, strict=True):
        for response in group.responses:
            assert (response.end_reason, response.infra_failure) == ("answer", None)
            assert response.turns == 2 and _sampled_runs(response, recorded) == 2
            # the trace, not a reply: (3 x correct + 1 x two assistant turns) / 4
            verdict = task.verify(row, response.final_turn)
            assert verdict.error is None and verdict.reward in (0.25, 1.0), verdict.reason
            rewards.append(verdict.reward)
    assert len(rewards) == 2 * GROUP
    print(f"verifiers taskset through the endpoint: rewards {rewards}")


def test_a_tool_job_trains_and_contains_hostile_code(ray_cluster, tool_model, tmp_path):
    """Also: a real Prometheus server reads the job's tool and trajectory series, and the
    job's reward plugin hangs on every other prompt: those score zero past
    reward.plugin_timeout_s and the steps complete (the reward pool's hung plugin rides on
    this job rather than start one of its own)."""
    escaped = Path("/tmp/groupflow-escaped-sandbox")
    escaped.unlink(missing_ok=True)
    job_port = free_port()
    settings = {
        "model.path": tool_model,
        "task.name": "tool_arithmetic",
        "task.eval_size": 8,
        "agent.tools": "[calculator, python]",
        "agent.environment": f"{PLUGINS}:HostilePython",
        "agent.tool_timeout_s": 1.0,
        "rollout.group_size": 4,
        "rollout.prompts_per_step": 4,
        "reward.num_workers": 1,
        "learner.num_ranks": 1,
        "reward.verifier": f"{REWARD_PLUGINS}:sleeps_past_timeout",
        "reward.plugin_timeout_s": 0.5,
        "reward.scorer_processes": 8,  # a step's hung calls wait out their deadline side by side
        "trainer.steps": 2,
        "trainer.log_samples_every": 1,
        "trainer.output_dir": str(tmp_path),
        "trainer.run_name": "agent",
        "metrics.prometheus_port": job_port,
        "metrics.prometheus_addr": "127.0.0.1",
    }
    args = ["train"] + [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    server = PrometheusServer(tmp_path, job_port)
    try:
        assert main(args) == 0
        scraped = _agent_series(server)
    finally:
        server.stop()
    run = tmp_path / "agent"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Prometheus read, at its last scrape, the running totals of the first one or two steps
    totals = [_agent_totals(records[:j]) for j in (1, 2)]
    assert scraped in totals, (scraped, totals)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r.keys() <= BY_KEY.keys(), r.keys() - BY_KEY.keys()
        assert r["turns_mean"] >= 1.0 and 0 < r["observation_token_share"] < 1
        assert r["tool_calls"]["python"] == 16  # one per trajectory
        assert sum(r["end_reasons"].values()) == 16
        assert len(r["tool_latency_s"]) >= r["tool_calls"]["python"] - r["tool_errors"].get(
            "(malformed)", 0
        )
    # A step's 16 calls take 16 programs in a row of the plugin's cycle of 6: each program
    # at least twice. The hang times out; the fork bomb, the read outside and the memory bomb
    # fail (or time out, on a loaded machine); the write outside lands in the sandbox's own
    # /tmp, gone with it.
    each = 2 * len(records)
    timeouts = sum(r["tool_timeouts"].get("python", 0) for r in records)
    errors = sum(r["tool_errors"].get("python", 0) for r in records)
    assert timeouts >= each and errors + timeouts >= 4 * each
    # and the driver said so while the job ran, naming the limit (issue 39)
    said = (run / "driver.log").read_text()
    assert "calls of tool 'python' timed out at agent.tool_timeout_s" in said
    samples = [
        json.loads(line)
        for path in sorted(run.glob("samples/step_*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert len(samples) == 32
    observations = [
        text for row in samples for piece in row["trajectory"] for text in piece.values()
    ]
    assert not any(MARKER in text for text in observations)  # nothing read outside
    assert any("42" in text for text in observations)  # the benign program ran
    assert not escaped.exists()
    # The reward plugin: the prompts it hangs on timed out and were masked (out of the
    # statistics and the loss, counted), the others scored 1, and the steps (and both
    # held-out evaluations, scored by it too) completed
    assert sum(r["reward_timeouts"] for r in records) > 0
    masked = sum(r["infra_failures"].get("verifier_timeout", 0) for r in records)
    assert masked > 0 and masked % 4 == 0  # whole groups: the plugin hangs by prompt
    assert sum(r["groups_dropped_infra"] for r in records) == masked // 4
    assert all(r["reward_mean"] == 1.0 for r in records)
    assert all(r["num_sequences"] + r["infra_failure_share"] * 16 == 16 for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    # The trained policy is a model directory of its own: its tokenizer renders a tool
    # conversation as the base's did (the template is in chat_template.jinja, which the model
    # directory once lacked, so that `groupflow eval` of it was refused).
    conversation = [
        {"role": "user", "content": "Compute 12*7."},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
        {"role": "tool", "content": "84"},
    ]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    rendered = [
        AutoTokenizer.from_pretrained(path).apply_chat_template(
            conversation, tools=tools, add_generation_prompt=True, tokenize=False
        )
        for path in (tool_model, run / "model")
    ]
    assert rendered[0] == rendered[1] and "84" in rendered[1]
    assert (run / "model" / "chat_template.jinja").is_file()


def test_a_dead_tool_worker_is_restarted_and_its_calls_run_again(ray_cluster):
    """A program running in a tool worker when it dies, and one sent while it restarts, run in
    the restarted worker (the only one): same handle, a new process."""
    cfg = build_config(
        {"agent": {"tools": ["python"], "tool_workers": 1, "allow_weak_sandbox": True}}
    )
    (worker,) = start_tool_pool(cfg)
    client = ToolPoolClient([worker])

    def pid_of(w):
        return ray.get(w.__ray_call__.remote(lambda self: os.getpid()))

    async def die_while_running():
        first = pid_of(worker)
        running = asyncio.ensure_future(client.run("import time; time.sleep(2); print(6*7)", 60))
        await asyncio.sleep(1.0)  # the program is running in the worker
        os.kill(first, signal.SIGKILL)
        sent = await asyncio.wait_for(client.run("print(7*8)", 60), 120)
        return first, await asyncio.wait_for(running, 120), sent

    try:
        first, ran, sent = asyncio.run(die_while_running())
        assert ran == (0, "42\n", "", False) and sent == (0, "56\n", "", False)
        assert pid_of(worker) != first
    finally:
        ray.kill(worker)


def _agent_totals(records: list[dict]) -> dict:
    """The series' values after these step records: the counters add up, one latency
    observation per call."""

    def added(key: str) -> dict:
        totals: dict[str, float] = {}
        for r in records:
            for label, n in r[key].items():
                totals[label] = totals.get(label, 0.0) + n
        return totals

    return {
        "calls": added("tool_calls"),
        "timeouts": added("tool_timeouts"),
        "end_reasons": added("end_reasons"),
        "latency_count": float(sum(len(r["tool_latency_s"]) for r in records)),
    }


def _agent_series(server: PrometheusServer) -> dict:
    """The agent series' newest values in the last 5 minutes, by label (the job's exporter is
    gone once it ends, so an instant query would find them stale)."""

    def by(label: str, metric: str) -> dict:
        rows = server.query(f'last_over_time({metric}{{job="groupflow"}}[5m])')
        return {row["metric"][label]: float(row["value"][1]) for row in rows}

    count = server.query(
        'last_over_time(groupflow_tool_latency_seconds_count{job="groupflow"}[5m])'
    )
    return {
        "calls": by("tool", "groupflow_tool_calls_total"),
        "timeouts": by("tool", "groupflow_tool_timeouts_total"),
        "end_reasons": by("reason", "groupflow_trajectory_end_reasons_total"),
        "latency_count": float(count[0]["value"][1]) if count else 0.0,
    }
