"""The `algorithm` section: the RL method (preset, advantages, loss, aggregation and the
token-credit transforms). Each `Literal` of an estimator, loss or transform names the keys of
its registry in learner/ (tests/unit/test_config_registries.py holds them equal)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from groupflow.config.base import FloatSetting, Section
from groupflow.config.presets import PRESETS


class ClipConfig(Section):
    """PPO's clipping of the probability ratio."""

    eps_low: FloatSetting = Field(
        0.2,
        ge=0,
        le=1,
        description="PPO clip below: the ratio r = pi/pi_old is held at >= 1 - eps_low for A < 0 "
        "(Schulman et al., PPO, arXiv 1707.06347)",
    )
    eps_high: FloatSetting = Field(
        0.28,
        ge=0,
        le=10,
        description="PPO clip above: r is held at <= 1 + eps_high for A > 0; 0.28 > eps_low is "
        "DAPO's clip-higher, which keeps low-probability tokens able to rise (arXiv 2503.14476)",
    )
    dual_clip: FloatSetting | None = Field(
        None,
        gt=1,
        le=100,
        description="dual clip c: for A < 0 the token loss is capped at -c A, so a huge ratio "
        "cannot blow up a negative sample (Ye et al., arXiv 1912.09729); unset = off",
    )


class KLConfig(Section):
    """A KL penalty to the initial policy."""

    coef: FloatSetting = Field(
        0.0,
        ge=0,
        le=10,
        description="beta of a KL penalty to the frozen initial policy, added per token (GRPO, "
        "arXiv 2402.03300); 0 = off and no reference model is loaded",
    )
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="per-token KL estimator: k1 = logp - ref, k2 = (logp - ref)^2 / 2, "
        "k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman, 'Approximating KL Divergence', 2020)",
    )


class StapoConfig(Section):
    """STAPO: silencing spurious tokens."""

    enabled: bool = Field(
        False,
        description="STAPO: silence spurious tokens (low probability, low entropy, in positive "
        "responses) and renormalise (arXiv 2602.15620); its would-be share is always measured",
    )
    tau_p: FloatSetting | Literal["auto"] = Field(
        0.002,
        description="STAPO probability threshold: candidates have p < tau_p (arXiv 2602.15620); "
        "'auto' sets it each mini-batch so that target_share of the running distribution of "
        "the probabilities STAPO examines (tokens of positive-advantage responses) is below it",
    )
    target_share: FloatSetting = Field(
        0.01,
        gt=0,
        lt=1,
        description="with tau_p: auto, the share of examined tokens to put below the threshold",
    )
    auto_decay: FloatSetting = Field(
        0.8,
        ge=0,
        lt=1,
        description="with tau_p: auto, how much of the running distribution each mini-batch "
        "keeps before adding its own tokens (0 = this mini-batch's alone)",
    )

    @field_validator("tau_p", mode="before")
    @classmethod
    def _tau_p_probability_or_auto(cls, tau_p: object) -> object:
        if tau_p == "auto":
            return tau_p
        if isinstance(tau_p, bool) or not isinstance(tau_p, int | float) or not 0 < tau_p <= 1:
            raise ValueError("must be a probability in (0, 1] or 'auto'")
        return tau_p

    quantile: FloatSetting = Field(
        0.75,
        ge=0,
        le=1,
        description="STAPO entropy quantile q: candidates with entropy below the q-quantile of "
        "the candidates' entropies are silenced (arXiv 2602.15620)",
    )
    prob_source: Literal["current", "old"] = Field(
        "current",
        description="whose p and entropy select STAPO's tokens: the current policy inside the "
        "mini-batch loop (the paper's choice) or the proximal policy (the learner's at the "
        "step's start)",
    )


class ARConfig(Section):
    """Advantage Reweighting of low-probability tokens."""

    alpha: FloatSetting = Field(
        0.0,
        ge=0,
        le=1,
        description="Advantage Reweighting: A <- (alpha p_old + 1 - alpha) A damps the "
        "low-probability tokens that dominate updates (Yang et al., arXiv 2505.12929; 0.3 for "
        "logic puzzles, 0.1 for math); 0 = off",
    )


class LoptiConfig(Section):
    """Lopti: low-probability tokens updated in a pass of their own."""

    enabled: bool = Field(
        False,
        description="Lopti: two optimizer passes per mini-batch, tokens with p_old < eta first, "
        "then the rest (Yang et al., arXiv 2505.12929)",
    )
    eta: FloatSetting = Field(
        0.5,
        ge=-1,
        le=1,
        description="Lopti probability threshold; eta < 0 updates the high-probability tokens "
        "first (arXiv 2505.12929)",
    )


class EntropyMaskConfig(Section):
    """Training only the highest-entropy tokens."""

    enabled: bool = Field(
        False,
        description="train only the highest-entropy tokens ('forking tokens'); the denominator "
        "keeps every valid token (Wang et al., 'Beyond the 80/20 Rule', arXiv 2506.01939)",
    )
    rho: FloatSetting = Field(
        0.2,
        gt=0,
        le=1,
        description="share of tokens kept, by entropy over the mini-batch (arXiv 2506.01939)",
    )


class DFPOConfig(Section):
    """DFPO's exchangeable group weights."""

    weight_transform: Literal["min_replace", "adv_orthogonal"] = Field(
        "min_replace",
        description="how dfpo makes the sequence weights of a group exchangeable so shared tokens "
        "cancel: the group's minimum weight, or the weights' component orthogonal to the "
        "advantages (arXiv 2604.13088)",
    )


class OffPolicyConfig(Section):
    """The off-policy correction of stale samples (decoupled PPO)."""

    mode: Literal["none", "tis", "mis"] = Field(
        "none",
        description="off-policy correction of decoupled PPO (Hilton et al., arXiv 2110.00641): "
        "each token's policy loss is weighted by w = pi_proximal / pi_behaviour, the learner's "
        "recomputed log-probs over vLLM's sampled ones. none: w = 1; tis: truncated, min(w, "
        "cap) (Yao et al., 'Your Efficient RL Framework Secretly Brings You Off-Policy RL "
        "Training', 2025); mis: masked, w inside the band and 0 outside (IcePop, arXiv "
        "2510.18855). Unset = tis when trainer.max_staleness > 0, else none",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="token: one w per token; sequence: one w per response, the product of its "
        "tokens' ratios, truncated or masked as a whole",
    )
    cap: FloatSetting = Field(
        2.0,
        ge=1,
        le=100,
        description="tis: the largest weight (>= 1, so an on-policy weight of 1 stays 1)",
    )
    band: tuple[FloatSetting, FloatSetting] = Field(
        (0.5, 2.0),
        description="mis: [low, high] of the weights kept, low <= 1 <= high <= 100 (cap's bound); a token (or "
        "response) outside it gets weight 0 and stays in the aggregation's denominator",
    )

    @model_validator(mode="after")
    def _check_band(self) -> OffPolicyConfig:
        low, high = self.band
        if not 0 <= low <= 1 <= high <= 100:
            raise ValueError(f"band {list(self.band)}: must satisfy 0 <= low <= 1 <= high <= 100")
        return self


EXCHANGEABLE_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "constant")


class AlgorithmConfig(Section):
    """The RL method: preset, advantages, loss, aggregation and token-credit transforms."""

    preset: str = Field(
        "grpo",
        description="named method (groupflow/config/presets.py): its keys are the defaults of this "
        "section, and any key set here overrides them",
    )
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_baseline"] = Field(
        "grpo",
        description="advantage estimator per group: grpo (R - mean) / std (DeepSeekMath, arXiv "
        "2402.03300); dr_grpo R - mean (arXiv 2503.20783); rloo R - leave-one-out mean (Ahmadian "
        "et al., arXiv 2402.14740); reinforce_baseline R - mean, whitened over the batch's tokens",
    )
    std: Literal["unbiased", "biased", "none"] = Field(
        "unbiased", description="the group standard deviation that grpo divides by"
    )
    loss: Literal["ppo", "gspo", "linear", "dfpo"] = Field(
        "ppo",
        description="per-token policy loss: ppo clipped surrogate (arXiv 1707.06347); gspo "
        "sequence-level ratio and clip (arXiv 2507.18071); linear clip-free -A logp (REINFORCE); "
        "dfpo linear with exchangeable group weights (arXiv 2604.13088)",
    )
    aggregation: Literal["token_mean", "seq_mean_token_sum", "constant", "seq_mean_token_mean"] = (
        Field(
            "token_mean",
            description="how token losses are summed into the step's loss; token_mean, "
            "seq_mean_token_sum and constant (Dr. GRPO, arXiv 2503.20783) give every response "
            "of a group the same coefficient, so tokens shared by good and bad responses cancel; "
            "seq_mean_token_mean (original GRPO) breaks that with unequal lengths (arXiv "
            "2604.13088)",
        )
    )
    clip: ClipConfig = Field(default_factory=ClipConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: FloatSetting = Field(
        0.0,
        ge=-1,
        le=1,
        description="weight of an entropy bonus subtracted from the loss (Williams and Peng, "
        "1991); 0 = off",
    )
    dynamic_sampling: bool = Field(
        False,
        description="drop groups whose rewards are all equal (they carry no gradient) and draw "
        "more prompts (DAPO, arXiv 2503.14476)",
    )
    stapo: StapoConfig = Field(default_factory=StapoConfig)
    ar: ARConfig = Field(default_factory=ARConfig)
    lopti: LoptiConfig = Field(default_factory=LoptiConfig)
    entropy_mask: EntropyMaskConfig = Field(default_factory=EntropyMaskConfig)
    dfpo: DFPOConfig = Field(default_factory=DFPOConfig)
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    lowprob_eta: FloatSetting = Field(
        0.5,
        gt=0,
        le=1,
        description="p threshold of the lowprob_frac and lowprob_grad_share diagnostics "
        "(arXiv 2505.12929)",
    )
    mask_truncated: bool = Field(
        False,
        description="train nothing on responses cut at rollout.sampling.max_tokens (DAPO's "
        "overlong filtering, arXiv 2503.14476): they still count in their group's baseline",
    )
    cancellation_diagnostic: bool = Field(
        True,
        description="measure cancellation_residual: how far the gradient on tokens shared "
        "within a group fails to cancel (arXiv 2604.13088); costs a per-token gradient capture",
    )

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.loss == "dfpo" and self.aggregation not in EXCHANGEABLE_AGGREGATIONS:
            raise ValueError(
                f"loss 'dfpo' relies on token gradient cancellation, which aggregation "
                f"{self.aggregation!r} breaks; use one of {list(EXCHANGEABLE_AGGREGATIONS)}"
            )
        return self
