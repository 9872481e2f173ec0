"""Every figure a job reports, defined once: its key in metrics.jsonl, what it means, its unit,
the Grafana panel that draws it and how Prometheus exports it.

metrics.jsonl's keys are this table's keys; groupflow/observe/prometheus.py builds its series from it,
groupflow/observe/plots.py draws its panels from it, and tests/unit/test_dashboard.py checks
deploy/grafana/groupflow.json against it. A key the job writes that is missing here fails the
end-to-end test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How a step-record value reaches Prometheus:
#   gauge          set to the step's value
#   counter        increased by the step's value (an amount per step)
#   running_total  a counter following a total the job keeps (it only grows; a restart of the
#                  source from zero is read as growth from zero)
#   histogram      the step's value is one observation
Kind = Literal["gauge", "counter", "running_total", "histogram"]


@dataclass(frozen=True)
class Series:
    name: str  # family name as registered (a counter's PromQL name adds _total)
    kind: Kind
    stage: str | None = None  # `stage` label, for a family that several keys share
    # A labelled family: the record's value is a mapping from this label's values to numbers
    # (e.g. {"math": 0.4, "code": 0.2} under label "task"), one series each.
    label: str | None = None


@dataclass(frozen=True)
class Metric:
    key: str  # the key in metrics.jsonl
    help: str
    unit: str  # "fraction" (0..1), "seconds", "nats", "tokens", ... ("" = a plain number)
    panel: str | None = None  # the Grafana panel (and plot panel) that draws it
    series: Series | None = None  # None: in metrics.jsonl only


def _gauge(name: str) -> Series:
    return Series(name, "gauge")


def _stage_latency(stage: str) -> Series:
    return Series(STAGE_LATENCY, "histogram", stage)


def _tokens_per_second(stage: str) -> Series:
    return Series(TOKENS_PER_SECOND, "gauge", stage)


STAGE_LATENCY = "groupflow_stage_latency_seconds"
TOKENS_PER_SECOND = "groupflow_tokens_per_second"

# The help of a family several keys share (told apart by their `stage` label).
FAMILY_HELP = {
    STAGE_LATENCY: "time spent in each stage of a step",
    TOKENS_PER_SECOND: "tokens per second of the last step, by stage",
}

_STEP = "Step and policy version"
_ENTROPY = "Entropy"
_TOKENS = "Spurious and low-probability tokens"
_CLIP = "Clip fractions"
_GRAD = "Gradient norm and log-prob mismatch"
_OFF_POLICY = "Off-policy correction"
_MOE = "Expert load balance"
_ROUTING = "Routing disagreement"
_SPEED = "Tokens per second by stage"
_TIMES = "Mean stage latency and step time"
_ERRORS = "Reward errors and timeouts"
_AGENT = "Turns per trajectory"
_AGENT_SHARES = "Tool use and observation share"
_TOOLS = "Tool calls, errors and timeouts"
_END_REASONS = "Trajectory end reasons"

METRICS: tuple[Metric, ...] = (
    # the step
    Metric("step", "last completed training step", "", _STEP, _gauge("groupflow_step")),
    Metric(
        "policy_version",
        "policy version the engines sample from",
        "",
        _STEP,
        _gauge("groupflow_policy_version"),
    ),
    Metric(
        "lr",
        "learning rate of the step's updates (learner.optimizer.lr_schedule)",
        "",
        "Learning rate",
        _gauge("groupflow_learning_rate"),
    ),
    # rollout figures (groupflow/observe/rollout_figures.py)
    Metric(
        "reward_mean",
        "mean sequence reward of the step's samples",
        "reward",
        "Reward",
        _gauge("groupflow_reward_mean"),
    ),
    Metric(
        "reward_std",
        "standard deviation of the step's rewards",
        "reward",
        "Reward",
        _gauge("groupflow_reward_std"),
    ),
    Metric(
        "accuracy",
        "fraction of the step's samples with full reward",
        "fraction",
        "Accuracy",
        _gauge("groupflow_accuracy"),
    ),
    Metric(
        "task_reward_mean",
        "mean reward of the step's samples, per task (a job of several tasks)",
        "",
        "Reward",
        Series("groupflow_task_reward_mean", "gauge", label="task"),
    ),
    Metric(
        "task_accuracy",
        "fraction of the step's samples with full reward, per task (a job of several tasks)",
        "fraction",
        "Accuracy",
        Series("groupflow_task_accuracy", "gauge", label="task"),
    ),
    # multi-turn trajectories (agent.*, docs/agents.md): in the records of such jobs only
    Metric(
        "turns_mean",
        "mean model turns per trajectory",
        "turns",
        _AGENT,
        _gauge("groupflow_turns_mean"),
    ),
    Metric(
        "tool_use_rate",
        "fraction of the step's trajectories that called a tool",
        "fraction",
        _AGENT_SHARES,
        _gauge("groupflow_tool_use_rate"),
    ),
    Metric(
        "observation_token_share",
        "fraction of the step's response tokens that observations inserted (not trained)",
        "fraction",
        _AGENT_SHARES,
        _gauge("groupflow_observation_token_share"),
    ),
    Metric(
        "tool_calls",
        "tool calls per step, per tool ('(malformed)': unreadable, '(unknown)': no such tool)",
        "calls",
        _TOOLS,
        Series("groupflow_tool_calls", "counter", label="tool"),
    ),
    Metric(
        "tool_errors",
        "tool calls per step that failed (raised, refused, unreadable, unknown), per tool",
        "calls",
        _TOOLS,
        Series("groupflow_tool_errors", "counter", label="tool"),
    ),
    Metric(
        "tool_timeouts",
        "tool calls per step killed at agent.tool_timeout_s, per tool",
        "calls",
        _TOOLS,
        Series("groupflow_tool_timeouts", "counter", label="tool"),
    ),
    Metric(
        "tool_latency_s",
        "seconds of each tool call that ran in the step (a list; Prometheus: a histogram)",
        "seconds",
        None,
        Series("groupflow_tool_latency_seconds", "histogram"),
    ),
    Metric(
        "end_reasons",
        "trajectories per step by why they ended (answer, turn_limit, token_limit, deadline, "
        "environment_error)",
        "trajectories",
        _END_REASONS,
        Series("groupflow_trajectory_end_reasons", "counter", label="reason"),
    ),
    Metric(
        "trajectory_splits",
        "sequences beyond the first that the step's harness trajectories split into where "
        "the harness rewrote its history (agent.harness; each trained with its trajectory's "
        "reward)",
        "sequences",
    ),
    Metric(
        "event_loop_blocks",
        "runs of async users' code (tools, environments) per step that held an engine's event "
        "loop 0.5 s or longer (each also a warning naming the code)",
        "runs",
        _TOOLS,
        Series("groupflow_event_loop_blocks", "counter"),
    ),
    Metric(
        "eval_accuracy",
        "held-out greedy accuracy (when evaluated: before training, every trainer.eval_every "
        "steps, after training)",
        "fraction",
        "Accuracy",
        _gauge("groupflow_eval_accuracy"),
    ),
    Metric(
        "eval_task_accuracy",
        "held-out greedy accuracy of each task of a job of several tasks, by label (when "
        "evaluated)",
        "fraction",
        "Accuracy",
        Series("groupflow_eval_task_accuracy", "gauge", label="task"),
    ),
    # Not a step record's: exported once as the job starts (summary.json has it too).
    Metric(
        "warm_start_accuracy",
        "held-out greedy accuracy before training (a resumed run: its checkpoint's)",
        "fraction",
        "Accuracy",
        _gauge("groupflow_warm_start_accuracy"),
    ),
    Metric(
        "eval_mean_at_n",
        "held-out mean reward of trainer.eval_samples sampled answers per prompt (mean@n)",
        "fraction",
        "Accuracy",
        _gauge("groupflow_eval_mean_at_n"),
    ),
    Metric(
        "eval_pass_at_k",
        "held-out pass@k (k = trainer.eval_pass_k) of the sampled answers, unbiased estimate",
        "fraction",
        "Accuracy",
        _gauge("groupflow_eval_pass_at_k"),
    ),
    Metric(
        "eval_set_accuracy",
        "greedy accuracy on each of task.eval_sets, by name (when evaluated)",
        "fraction",
        "Accuracy",
        Series("groupflow_eval_set_accuracy", "gauge", label="eval_set"),
    ),
    Metric(
        "eval_set_mean_at_n",
        "mean@n on each of task.eval_sets, by name (with trainer.eval_samples)",
        "fraction",
        "Accuracy",
        Series("groupflow_eval_set_mean_at_n", "gauge", label="eval_set"),
    ),
    Metric(
        "eval_set_pass_at_k",
        "pass@k on each of task.eval_sets, by name (with trainer.eval_samples)",
        "fraction",
        "Accuracy",
        Series("groupflow_eval_set_pass_at_k", "gauge", label="eval_set"),
    ),
    Metric(
        "response_len_mean",
        "mean response length in tokens",
        "tokens",
        "Response length",
        _gauge("groupflow_response_length_mean"),
    ),
    Metric(
        "tokens_generated",
        "response tokens generated",
        "tokens",
        _SPEED,
        Series("groupflow_tokens_generated", "counter"),
    ),
    Metric("num_groups", "groups trained on (after dynamic sampling)", ""),
    Metric(
        "groups_with_spread",
        "groups trained on whose rewards differ: the others (all rewards equal) teach nothing "
        "(groupflow/observe/learning_signal.py)",
        "",
    ),
    Metric("num_sequences", "sequences trained on", ""),
    Metric(
        "groups_filtered",
        "groups dynamic sampling skipped (all rewards equal), each replaced by a new prompt",
        "",
        "Staleness",
        Series("groupflow_groups_filtered", "counter"),
    ),
    Metric(
        "groups_dropped_stale",
        "groups older than trainer.max_staleness, dropped untrained (a dynamic-sampling "
        "refill's surplus at staleness 0, or an engine that missed a weight load)",
        "",
        "Staleness",
        Series("groupflow_groups_dropped_stale", "counter"),
    ),
    Metric(
        "staleness_mean",
        "mean policy versions behind, trained samples",
        "versions",
        "Staleness",
        _gauge("groupflow_staleness_mean"),
    ),
    Metric(
        "staleness_max",
        "largest policy lag among trained samples",
        "versions",
        "Staleness",
        _gauge("groupflow_staleness_max"),
    ),
    Metric(
        "gen_tokens_per_s",
        "tokens generated per second of the step's generation",
        "tokens/s",
        _SPEED,
        _tokens_per_second("generation"),
    ),
    Metric(
        "learn_tokens_per_s",
        "response tokens trained on per second of learning",
        "tokens/s",
        _SPEED,
        _tokens_per_second("learning"),
    ),
    # stage times (groupflow/core/timing.py)
    Metric(
        "time_gen_s",
        "from sending the step's first chunk to an engine to its last chunk generated",
        "seconds",
        _TIMES,
        _stage_latency("generation"),
    ),
    Metric(
        "time_reward_s",
        "waiting for scores once the step's generation had finished",
        "seconds",
        _TIMES,
        _stage_latency("reward"),
    ),
    Metric(
        "time_learn_s",
        "the learner's update (later steps' chunks are scored meanwhile)",
        "seconds",
        _TIMES,
        _stage_latency("learning"),
    ),
    Metric(
        "time_wait_rollout_s",
        "the learner waiting for the step's next groups to finish generating",
        "seconds",
        _TIMES,
    ),
    Metric(
        "time_sync_s",
        "the learner's side of the weight sync (each engine loads between two of its steps)",
        "seconds",
        _TIMES,
        _stage_latency("weight_sync"),
    ),
    Metric(
        "time_engines_idle_s",
        "the time an engine held no chunk to generate (waiting for the learner), per engine",
        "seconds",
        _TIMES,
    ),
    Metric("time_metrics_s", "computing the step's figures", "seconds", _TIMES),
    Metric(
        "time_step_s",
        "wall time of the step",
        "seconds",
        _TIMES,
        _gauge("groupflow_step_duration_seconds"),
    ),
    # the reward pool
    Metric(
        "reward_errors",
        "reward scoring errors so far (the verifier raised or returned garbage)",
        "",
        _ERRORS,
        Series("groupflow_reward_errors", "running_total"),
    ),
    Metric(
        "reward_timeouts",
        "reward scoring timeouts so far",
        "",
        _ERRORS,
        Series("groupflow_reward_timeouts", "running_total"),
    ),
    Metric(
        "infra_failures",
        "responses per step masked for failures not the model's, by reason (environment_error, "
        "environment_deadline, tool_worker_lost, verifier_error, verifier_timeout)",
        "responses",
        _ERRORS,
        Series("groupflow_infra_failures", "counter", label="reason"),
    ),
    Metric(
        "groups_dropped_infra",
        "groups left with fewer than two valid members after masking, dropped untrained",
        "",
        _ERRORS,
        Series("groupflow_groups_dropped_infra", "counter"),
    ),
    Metric(
        "infra_failure_share",
        "share of the step's responses masked (reward.max_infra_failure_share bounds it)",
        "fraction",
    ),
    # recovery and checkpoints (groupflow/loop/job.py; the checkpoint figures only with
    # trainer.checkpoint_every)
    Metric(
        "engine_restarts",
        "engines replaced after they died, so far",
        "",
        "Restarts",
        Series("groupflow_engine_restarts", "running_total"),
    ),
    Metric(
        "learner_restarts",
        "learner groups rebuilt from a checkpoint after a rank died, so far",
        "",
        "Restarts",
        Series("groupflow_learner_restarts", "running_total"),
    ),
    # weight sync (actors/transport.py): a load that fails its check ends the job instead
    Metric(
        "weight_sync_verified",
        "engine weight loads finished since the previous step whose checksum of every tensor "
        "matched what the learner sent",
        "",
        "Weight sync",
        Series("groupflow_weight_sync_verified", "counter"),
    ),
    # scaling (groupflow/loop/scaling.py): the counts a step ran with; live counts are LIVE_GAUGES
    Metric("num_engines", "generator engines that served the step", ""),
    Metric("num_reward_workers", "reward workers that served the step", ""),
    Metric(
        "scale_events",
        "scale events after the step: a target changed (groupflow scale, autoscale) or "
        "actors joined or left",
        "",
        "Scaling",
        Series("groupflow_scale_events", "counter"),
    ),
    Metric(
        "checkpoint_seconds",
        "seconds the newest checkpoint took to save (absent before the first)",
        "seconds",
        "Checkpoints",
        _gauge("groupflow_checkpoint_seconds"),
    ),
    Metric(
        "seconds_since_checkpoint",
        "seconds since the newest checkpoint was complete (or since the job started)",
        "seconds",
        "Checkpoints",
        _gauge("groupflow_seconds_since_checkpoint"),
    ),
    # learner figures (groupflow.learner.figures.learner_record)
    Metric(
        "entropy_mean",
        "mean token entropy of the responses",
        "nats",
        _ENTROPY,
        _gauge("groupflow_entropy_mean"),
    ),
    Metric(
        "entropy_pos",
        "mean token entropy, positive-advantage samples",
        "nats",
        _ENTROPY,
        _gauge("groupflow_entropy_pos"),
    ),
    Metric(
        "entropy_neg",
        "mean token entropy, negative-advantage samples",
        "nats",
        _ENTROPY,
        _gauge("groupflow_entropy_neg"),
    ),
    Metric(
        "spurious_frac",
        "fraction of tokens flagged spurious (STAPO)",
        "fraction",
        _TOKENS,
        _gauge("groupflow_spurious_frac"),
    ),
    Metric(
        "lowprob_frac",
        "fraction of low-probability tokens",
        "fraction",
        _TOKENS,
        _gauge("groupflow_lowprob_frac"),
    ),
    Metric(
        "lowprob_grad_share",
        "share of the gradient norm from low-probability tokens",
        "fraction",
        _TOKENS,
        _gauge("groupflow_lowprob_grad_share"),
    ),
    Metric("stapo_silenced_frac", "fraction of tokens STAPO silenced", "fraction", _TOKENS),
    Metric(
        "stapo_tau_p",
        "STAPO's probability threshold (set from the data with stapo.tau_p: auto)",
        "probability",
    ),
    Metric("trained_frac", "fraction of tokens that carry a gradient", "fraction"),
    Metric("valid_tokens", "response tokens of the step, over all ranks", "tokens"),
    Metric("optimizer_passes", "optimizer passes per mini-batch (Lopti makes two)", ""),
    Metric(
        "cancellation_residual",
        "residual of token-gradient cancellation within groups",
        "",
        "Cancellation residual",
        _gauge("groupflow_cancellation_residual"),
    ),
    Metric(
        "cancellation_residual_whole_group",
        "the residual over prefixes every response of the group shares (0 when exchangeable)",
        "",
        "Cancellation residual",
    ),
    Metric(
        "clip_frac_low",
        "fraction of tokens clipped at 1 - eps_low",
        "fraction",
        _CLIP,
        _gauge("groupflow_clip_frac_low"),
    ),
    Metric(
        "clip_frac_high",
        "fraction of tokens clipped at 1 + eps_high",
        "fraction",
        _CLIP,
        _gauge("groupflow_clip_frac_high"),
    ),
    Metric("clip_frac", "clip_frac_low + clip_frac_high", "fraction"),
    Metric(
        "approx_kl",
        "approximate KL between old and current policy",
        "nats",
        "Approx. KL",
        _gauge("groupflow_approx_kl"),
    ),
    Metric("kl_ref", "KL to the reference policy (when algorithm.kl.coef > 0)", "nats"),
    Metric("grad_norm", "gradient norm before clipping", "", _GRAD, _gauge("groupflow_grad_norm")),
    Metric("optimizer_updates", "optimizer updates in the step", ""),
    Metric(
        "logp_mismatch_mean",
        "mean |vLLM logprob - learner logprob| per token",
        "nats",
        _GRAD,
        _gauge("groupflow_logp_mismatch_mean"),
    ),
    Metric("logp_mismatch_max", "largest |vLLM logprob - learner logprob|", "nats"),
    # a mixture of experts' routers (learner/routing_replay.py), where the engines return routing
    Metric(
        "routing_disagreement",
        "share of (token, layer) pairs whose top-k experts the engine and the learner's own "
        "router chose differently (before routing replay's override; absent: no routing)",
        "fraction",
        _ROUTING,
        _gauge("groupflow_routing_disagreement"),
    ),
    # the sync probe (groupflow/core/sync_probe.py): a load whose probe is past its dtype's
    # tolerance ends the job instead
    Metric(
        "sync_probe_diff_mean",
        "mean |engine logprob - learner logprob| of the sync probe with the weights an engine "
        "loaded, the worst load checked since the previous step (absent: none checked)",
        "nats",
        _GRAD,
        _gauge("groupflow_sync_probe_diff_mean"),
    ),
    Metric(
        "sync_probe_diff_max",
        "largest |engine logprob - learner logprob| of a sync probe token, over the loads "
        "checked since the previous step",
        "nats",
        _GRAD,
        _gauge("groupflow_sync_probe_diff_max"),
    ),
    # a mixture of experts' routing on the learner (learner/moe_aux.py); absent for a dense model
    Metric(
        "expert_load_max_over_mean",
        "per mixture-of-experts layer, the most of the step's trained tokens an expert got over "
        "the mean per expert (1: balanced; the number of experts: all to one)",
        "",
        _MOE,
        Series("groupflow_expert_load_max_over_mean", "gauge", label="layer"),
    ),
    Metric(
        "moe_aux_loss",
        "the load-balancing auxiliary loss per trained token (learner.moe.aux_loss_coef weighs "
        "it into the loss; reported at any weight)",
        "",
        _MOE,
        _gauge("groupflow_moe_aux_loss"),
    ),
    # the off-policy correction (groupflow.learner.off_policy), over tokens with vLLM's log-probs
    Metric(
        "is_weight_mean",
        "mean importance weight pi_proximal / pi_behaviour, before truncation or masking",
        "",
        _OFF_POLICY,
        _gauge("groupflow_is_weight_mean"),
    ),
    Metric(
        "is_weight_max",
        "largest importance weight, before truncation or masking",
        "",
        _OFF_POLICY,
        _gauge("groupflow_is_weight_max"),
    ),
    Metric(
        "is_truncated_frac",
        "fraction of tokens whose importance weight was truncated (off_policy.mode tis)",
        "fraction",
        _CLIP,
        _gauge("groupflow_is_truncated_frac"),
    ),
    Metric(
        "is_masked_frac",
        "fraction of tokens whose importance weight was masked to 0 (off_policy.mode mis)",
        "fraction",
        _CLIP,
        _gauge("groupflow_is_masked_frac"),
    ),
    Metric(
        "kl_behaviour_proximal",
        "k3 estimate of KL(behaviour || proximal): vLLM's sampler against the learner",
        "nats",
        _OFF_POLICY,
        _gauge("groupflow_kl_behaviour_proximal"),
    ),
    Metric(
        "actor_memory_bytes",
        "the step's peak memory of the largest actor of each pool (learner: a rank's, resident "
        "on a CPU, allocated on a GPU); deploy/alerts.yml warns before Ray's memory monitor kills",
        "bytes",
        "Actor memory",
        Series("groupflow_actor_memory_bytes", "gauge", label="pool"),
    ),
    Metric(
        "actor_memory_limit_bytes",
        "the memory an actor of each pool may use (learner: learner.memory_gib, or its share "
        "of the node or device)",
        "bytes",
        "Actor memory",
        Series("groupflow_actor_memory_limit_bytes", "gauge", label="pool"),
    ),
)


BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}

# Keys an older groupflow wrote to metrics.jsonl -> their names today, so that reading an old
# run (its plots, a resumed run's earlier steps) finds its figures.
RENAMED_KEYS: dict[str, str] = {"num_stages": "optimizer_passes"}


def with_current_keys(record: dict) -> dict:
    """A step record as read from metrics.jsonl, its renamed keys under today's names."""
    return {RENAMED_KEYS.get(key, key): value for key, value in record.items()}
