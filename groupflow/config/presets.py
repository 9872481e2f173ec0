"""Named algorithm presets: one config key (`algorithm.preset`) selects a method.

Each preset is a partial `algorithm` section. The user's own `algorithm.*` keys are
applied on top, so any single field can still be overridden.
"""

PRESETS: dict[str, dict] = {
    # GRPO (Shao et al., DeepSeekMath, arXiv 2402.03300) with our cancellation-safe
    # defaults: one global token denominator and DAPO's clip-higher range.
    "grpo": {},
    # DAPO (arXiv 2503.14476): clip-higher, token-level mean, dynamic sampling.
    "dapo": {
        "clip": {"eps_low": 0.2, "eps_high": 0.28},
        "aggregation": "token_mean",
        "dynamic_sampling": True,
    },
    # Dr. GRPO (arXiv 2503.20783): no std normalisation, constant denominator.
    "dr_grpo": {"advantage": "dr_grpo", "aggregation": "constant"},
    # STAPO (arXiv 2602.15620): silence spurious tokens, no KL, clip [0.8, 1.28].
    "stapo": {
        "stapo": {"enabled": True, "tau_p": 0.002, "quantile": 0.75},
        "clip": {"eps_low": 0.2, "eps_high": 0.28},
        "kl": {"coef": 0.0},
    },
    # Advantage Reweighting (arXiv 2505.12929), alpha = 0.3 as for logic puzzles.
    "ar": {"ar": {"alpha": 0.3}},
    # Lopti (arXiv 2505.12929): low-probability tokens updated first, eta = 0.5.
    "lopti": {"lopti": {"enabled": True, "eta": 0.5}},
    # AR + Lopti together, the combination the paper reports as best.
    "ar_lopti": {"ar": {"alpha": 0.3}, "lopti": {"enabled": True, "eta": 0.5}},
    # "Beyond the 80/20 rule" (arXiv 2506.01939): train only the top-20% entropy tokens.
    "entropy20": {"entropy_mask": {"enabled": True, "rho": 0.2}},
    # GSPO (arXiv 2507.18071): sequence-level ratio and clipping.
    "gspo": {
        "loss": "gspo",
        "aggregation": "seq_mean_token_mean",
        "clip": {"eps_low": 0.0003, "eps_high": 0.0004},
    },
    # Cancellation-safe sequence weights (arXiv 2604.13088): linear loss, group
    # weights made orthogonal to the advantages, exchangeable aggregation.
    "dfpo": {
        "loss": "dfpo",
        "aggregation": "token_mean",
        "dfpo": {"weight_transform": "min_replace"},
    },
}
