"""The engine's routing capture (rollout/routing_capture.py), without vLLM: a forward's rows
filed under the request and position of each token, a recomputed position keeping its latest
routing, and a finished request's samples found under vLLM's own request ids."""

from __future__ import annotations

import numpy as np
import torch

from groupflow.rollout.routing_capture import RoutingCapture


def _forward(capture: RoutingCapture, layer_ids: list[list[list[int]]]) -> None:
    for layer, ids in enumerate(layer_ids):
        capture.capture(layer, torch.tensor(ids))


def test_each_token_is_filed_under_its_request_and_position():
    capture = RoutingCapture(layers=2, top_k=2, experts=8)
    # a prefill of request A's 3 tokens beside a decode of request B's token at position 5
    _forward(capture, [[[0, 1], [2, 3], [4, 5], [6, 7]], [[1, 0], [3, 2], [5, 4], [7, 6]]])
    capture.file_step(np.array([0, 1, 2, 5]), ["7-ab", "0_8-cd"], [3, 1])
    _forward(capture, [[[1, 2]], [[3, 4]]])  # A's first decode step
    capture.file_step(np.array([3]), ["7-ab"], [1])
    (a,) = capture.take("7", 1)
    assert a.dtype == np.uint8 and a.shape == (4, 2, 2)
    assert a[:, 0].tolist() == [[0, 1], [2, 3], [4, 5], [1, 2]]
    assert a[:, 1].tolist() == [[1, 0], [3, 2], [5, 4], [3, 4]]
    # request 8's samples: its sample 0 ran one position so far (rows before it: zeros)
    b, other = capture.take("8", 2)
    assert other is None and b.shape == (6, 2, 2) and b[5, 0].tolist() == [6, 7]
    assert capture.requests == {}


def test_a_recomputed_position_keeps_its_latest_routing():
    """A request preempted by a weight load computes its positions again under the new
    weights: the routing it goes on with is theirs."""
    capture = RoutingCapture(layers=1, top_k=2, experts=300)
    _forward(capture, [[[0, 1], [2, 3]]])
    capture.file_step(np.array([0, 1]), ["1-x"], [2])
    _forward(capture, [[[9, 8], [7, 6], [5, 4]]])
    capture.file_step(np.array([0, 1, 2]), ["1-x"], [3])
    (r,) = capture.take("1", 1)
    assert r.dtype == np.uint16 and r[:, 0].tolist() == [[9, 8], [7, 6], [5, 4]]


def test_samples_of_other_requests_are_left_alone():
    capture = RoutingCapture(layers=1, top_k=1, experts=4)
    _forward(capture, [[[0], [1], [2]]])
    capture.file_step(np.array([0, 0, 0]), ["1_12-x", "12-y", "1_2-z"], [1, 1, 1])
    assert capture.take("2", 2)[1] is not None
    assert capture.take("12", 1)[0] is not None
    assert sorted(capture.requests) == ["1_12-x"]
