"""Sample logs: one row per response with what a person needs to judge it, readable as a table."""

import json
import random

from groupflow.core.records import Prompt, Response, SampledGroup, ScoredGroup, Verdict
from groupflow.observe.sample_log import TABLE_WIDTH, sample_rows, sample_table, write_samples


def _decode(ids: list[int]) -> str:
    return "|".join(map(str, ids))


def _scored(rng: random.Random, n_groups: int, size: int) -> list[ScoredGroup]:
    groups = []
    for g in range(n_groups):
        responses = [
            Response(
                token_ids=list(range(rng.randint(1, 9))),
                text=rng.choice(["12", "x\ny", "\ud800 lone", "a" * 200]),
                logprobs=[],
                finish_reason=rng.choice(["stop", "length"]),
            )
            for _ in range(size)
        ]
        verdicts = [Verdict(float(rng.random() < 0.5), f"r{g}.{j}") for j in range(size)]
        prompt = Prompt(f"u{g}", f"{g}+{g}=", g + g)
        groups.append(ScoredGroup(SampledGroup(prompt, [1, 2], responses, g % 3), verdicts))
    return groups


def test_rows_carry_every_response_with_its_advantage_and_survive_a_round_trip(tmp_path):
    rng = random.Random()
    n_groups, size = rng.randint(1, 5), rng.randint(1, 6)
    scored = _scored(rng, n_groups, size)
    advantages = [[rng.gauss(0, 1) for _ in range(size)] for _ in range(n_groups)]
    rows = sample_rows(7, scored, advantages, _decode)
    path = write_samples(tmp_path, 7, rows)

    assert path == tmp_path / "samples" / "step_7.jsonl"
    back = [json.loads(line) for line in path.read_text().splitlines()]
    assert back == rows
    flat = [(sg, j) for sg in scored for j in range(size)]
    for row, (sg, j), adv in zip(back, flat, sum(advantages, []), strict=True):
        resp = sg.group.responses[j]
        assert row["prompt"] == _decode(sg.group.prompt_ids)  # what the model saw
        assert row["response"] == resp.text and row["length"] == len(resp.token_ids)
        assert row["reward"] == sg.verdicts[j].reward and row["reason"] == sg.verdicts[j].reason
        assert row["advantage"] == adv and row["finish_reason"] == resp.finish_reason
        assert row["policy_version"] == sg.group.policy_version and row["step"] == 7


def test_table_is_one_bounded_line_per_row():
    rng = random.Random()
    scored = _scored(rng, 4, 4)
    rows = sample_rows(1, scored, [[0.5] * 4] * 4, _decode)
    rows[0]["response"] = "a lone surrogate \ud800 and\nnew lines"
    table = sample_table(rows, len(rows), rng)
    table.encode("utf-8")  # printable: a lone surrogate cannot reach the terminal
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(len(line) <= 2 * TABLE_WIDTH + 21 for line in lines)


def test_sample_log_writes_every_nth_step_only(tmp_path, capsys):
    from groupflow.config import TrainerConfig
    from groupflow.observe.sample_log import SampleLog

    rng = random.Random()
    every = rng.randint(2, 4)
    log = SampleLog(tmp_path, TrainerConfig(log_samples_every=every, log_samples_shown=2), _decode)
    scored = _scored(rng, 2, 3)
    for step in range(1, 3 * every + 1):
        log(step, scored, [[0.0] * 3] * 2)
    written = sorted(int(p.stem.split("_")[1]) for p in (tmp_path / "samples").iterdir())
    assert written == [every, 2 * every, 3 * every]
    assert capsys.readouterr().err.count("samples (") == 3
    SampleLog(tmp_path / "off", TrainerConfig(), _decode)(1, scored, [[0.0] * 3] * 2)
    assert not (tmp_path / "off").exists()
