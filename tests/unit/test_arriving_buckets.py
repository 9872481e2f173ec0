"""An engine's bucket references arrive in any order (Ray starts an async actor's calls in no
guaranteed order) and are taken in bucket order (actors/generator.py ArrivingBuckets)."""

from __future__ import annotations

import random
import threading

import pytest

from groupflow.actors.generator import ArrivingBuckets


@pytest.mark.parametrize("trial", range(5))
def test_buckets_put_in_any_order_are_taken_in_bucket_order(trial):
    n = random.randint(1, 40)
    order = random.sample(range(n), n)
    arriving, taken = ArrivingBuckets(), []
    reader = threading.Thread(target=lambda: taken.extend(arriving.get(i) for i in range(n)))
    reader.start()
    for i in order:
        arriving.put(i, [f"ref {i}"])
    reader.join(timeout=10)
    assert taken == [[f"ref {i}"] for i in range(n)]


def test_a_failed_stream_ends_every_wait_from_where_it_failed():
    arriving = ArrivingBuckets()
    arriving.put(0, ["ref 0"])
    arriving.put(2, None)  # the stream failed after two buckets; bucket 1 comes late
    arriving.put(1, ["ref 1"])
    arriving.wait_first()
    assert [arriving.get(i) for i in range(4)] == [["ref 0"], ["ref 1"], None, None]
