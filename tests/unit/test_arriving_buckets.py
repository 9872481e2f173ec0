"""An engine's bucket partitions arrive from every learner rank in any order (Ray starts an
async actor's calls in no guaranteed order) and whole buckets are taken in bucket order
(actors/transport_object_store.py ArrivingBuckets)."""

from __future__ import annotations

import random
import threading

import pytest

from groupflow.actors.transport_object_store import ArrivingBuckets


def _reader(arriving: ArrivingBuckets, n: int) -> tuple[threading.Thread, list]:
    taken: list = []
    reader = threading.Thread(target=lambda: taken.extend(arriving.get(i) for i in range(n)))
    reader.start()
    return reader, taken


@pytest.mark.parametrize("trial", range(5))
def test_partitions_put_in_any_order_are_taken_whole_in_bucket_order(trial):
    n, ranks = random.randint(1, 40), random.randint(1, 4)
    parts = random.sample([(i, r) for i in range(n) for r in range(ranks)], n * ranks)
    arriving = ArrivingBuckets()
    reader, taken = _reader(arriving, n)
    cut = random.randint(0, len(parts))  # partitions may come before the load expects them
    for i, r in parts[:cut]:
        arriving.put(i, r, [f"ref {i}/{r}"])
    arriving.expect(ranks)
    for i, r in parts[cut:]:
        arriving.put(i, r, [f"ref {i}/{r}"])
    reader.join(timeout=10)
    assert taken == [[f"ref {i}/{r}" for r in range(ranks)] for i in range(n)]


def test_a_rank_that_fails_ends_every_wait_from_where_it_failed():
    arriving = ArrivingBuckets()
    arriving.expect(2)
    for r in range(2):
        arriving.put(0, r, [f"ref 0/{r}"])
    arriving.put(1, 1, ["ref 1/1"])
    arriving.put(2, 0, None)  # rank 0 failed after two buckets; its bucket 1 comes late
    arriving.put(1, 0, ["ref 1/0"])
    arriving.put(2, 1, ["ref 2/1"])
    arriving.wait_first()
    assert [arriving.get(i) for i in range(4)] == [
        ["ref 0/0", "ref 0/1"],
        ["ref 1/0", "ref 1/1"],
        None,
        None,
    ]


def test_a_rank_lost_ends_the_buckets_not_whole_yet():
    arriving = ArrivingBuckets()
    arriving.expect(2)
    for r in range(2):
        arriving.put(0, r, [f"ref 0/{r}"])
    arriving.put(1, 1, ["ref 1/1"])
    reader, taken = _reader(arriving, 3)
    arriving.fail()  # rank 0's process is gone: its push's handle failed
    reader.join(timeout=10)
    assert taken == [["ref 0/0", "ref 0/1"], None, None]
