"""The job loop's contracts (groupflow/core/peers.py) hold what the loop needs to know of its peers,
so that the loop runs without Ray: its unit tests drive it with in-process fakes."""

from __future__ import annotations

import subprocess
import sys

from groupflow.core.peers import CHUNKS_PER_ENGINE, chunk_size

# The loop, its contracts and the scaling policy; none may bring Ray (or vLLM) in.
LOOP_MODULES = (
    "groupflow.loop.job",
    "groupflow.loop.pipeline",
    "groupflow.loop.prompt_stream",
    "groupflow.core.peers",
    "groupflow.loop.scaling",
    "groupflow.core.scaling_protocol",
)


def test_the_loop_imports_no_ray():
    imports = "; ".join(f"import {m}" for m in LOOP_MODULES)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; {imports}; print(sorted({{'ray', 'vllm'}} & set(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_step_is_cut_into_chunks_per_engine():
    assert CHUNKS_PER_ENGINE == 2
    assert chunk_size(32, 2) == 8  # two chunks on each of two engines
    assert chunk_size(32, 3) == 5  # the rest is drawn as further chunks
    assert chunk_size(3, 4) == 1  # never an empty chunk
