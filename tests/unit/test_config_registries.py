"""The config names the algorithm's pieces with `Literal`s (groupflow/config/algorithm.py), so
that a typo is refused before anything starts, while learner/ looks each name up in its own
registry. The two lists are written twice, in two layers; these tests hold them equal, so that
a piece added to a registry without its name in the config (or the reverse) fails here."""

from __future__ import annotations

import typing

import pytest

from groupflow.config import AlgorithmConfig, DFPOConfig, KLConfig
from groupflow.learner.advantages import ADVANTAGE_ESTIMATORS, StdMode
from groupflow.learner.credit import DFPO_WEIGHT_TRANSFORMS
from groupflow.learner.losses import KL_ESTIMATORS, POLICY_LOSSES


def literal_values(section: type, field: str) -> set[str]:
    annotation = section.model_fields[field].annotation
    assert typing.get_origin(annotation) is typing.Literal, f"{section.__name__}.{field}"
    return set(typing.get_args(annotation))


@pytest.mark.parametrize(
    "section, field, registry",
    [
        (AlgorithmConfig, "loss", POLICY_LOSSES),
        (AlgorithmConfig, "advantage", ADVANTAGE_ESTIMATORS),
        (KLConfig, "estimator", KL_ESTIMATORS),
        (DFPOConfig, "weight_transform", DFPO_WEIGHT_TRANSFORMS),
    ],
    ids=["policy losses", "advantage estimators", "KL estimators", "DFPO transforms"],
)
def test_each_algorithm_literal_names_exactly_its_registrys_keys(section, field, registry):
    assert literal_values(section, field) == set(registry)


def test_the_group_std_modes_are_the_advantages_own():
    assert literal_values(AlgorithmConfig, "std") == set(typing.get_args(StdMode))
