"""`groupflow score`: output lines, option parsing, and bad input."""

import json

import pytest

from groupflow.reward_workers.score_cli import main


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_scores_every_line(tmp_path, capsys):
    path = write(
        tmp_path / "r.jsonl",
        [
            {"prompt": "37+45=", "answer": 82, "response": "82", "uid": "a"},
            {"prompt": "1+1=", "answer": 2, "response": "3"},
        ],
    )
    code, lines, err = run(capsys, ["--task", "arithmetic", "--input", path])
    assert code == 0
    assert [(line["line"], line["uid"], line["reward"]) for line in lines] == [
        (1, "a", 1.0),
        (2, "r.jsonl:2", 0.0),
    ]
    assert all(line["reason"] for line in lines)
    assert "2 responses, mean reward 0.5000, 0 errors, 0 timeouts" in err


def test_task_options_are_parsed_as_json(tmp_path, capsys):
    answer = {"numbers": [6, 4], "target": 24}
    path = write(tmp_path / "r.jsonl", [{"prompt": "p", "answer": answer, "response": "6*4"}])
    code, lines, _ = run(
        capsys, ["--task", "countdown", "--option", "format_weight=0.5", "--input", path]
    )
    assert code == 0
    assert lines[0]["reward"] == 0.5  # correct, but not inside <answer> tags


def test_plugin_is_used_and_its_errors_reported(tmp_path, capsys):
    plugin = tmp_path / "p.py"
    plugin.write_text("def reward(prompt, response, answer):\n    return 1 / int(response)\n")
    path = write(
        tmp_path / "r.jsonl",
        [
            {"prompt": "q", "answer": 1, "response": "1"},
            {"prompt": "q", "answer": 1, "response": "0"},
        ],
    )
    code, lines, err = run(
        capsys, ["--task", "arithmetic", "--plugin", f"{plugin}:reward", "--input", path]
    )
    assert code == 0
    assert [line["reward"] for line in lines] == [1.0, 0.0]
    assert lines[1]["error"] == "error" and "ZeroDivisionError" in lines[1]["reason"]
    assert "1 errors" in err


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{oops", "r.jsonl:2: not valid JSON"),
        ({"prompt": "1+1=", "answer": 2}, "r.jsonl:2: field 'response': missing"),
        (
            {"prompt": "1+1=", "answer": 2, "response": 5},
            "r.jsonl:2: field 'response': expected text, got int",
        ),
        ({"answer": 2, "response": "2"}, "r.jsonl:2: field 'prompt' (prompt): missing"),
        (
            {"prompt": "1+1=", "answer": "two", "response": "2"},
            "r.jsonl:2: field 'answer' (answer): expected an integer",
        ),
    ],
)
def test_a_bad_line_is_a_one_line_error_and_exit_2(tmp_path, capsys, row, message):
    path = write(tmp_path / "r.jsonl", [{"prompt": "1+1=", "answer": 2, "response": "2"}, row])
    code, lines, err = run(capsys, ["--task", "arithmetic", "--input", path])
    assert code == 2
    assert lines == []  # nothing is scored when any line is bad
    assert err.strip().count("\n") == 0
    assert message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "chess", "--input", "x.jsonl"], "unknown task 'chess'"),
        (["--task", "arithmetic", "--input", "missing.jsonl"], "missing.jsonl: no such file"),
        (["--task", "arithmetic", "--input", "x.parquet"], "expected a .jsonl file"),
        (["--task", "arithmetic", "--option", "nokey", "--input", "x.jsonl"], "expected KEY=VALUE"),
        (["--task", "arithmetic", "--option", "digitz=3", "--input", "x.jsonl"], "task.options"),
        (
            ["--task", "arithmetic", "--plugin", "no_module_xyz:f", "--input", "x.jsonl"],
            "reward plugin",
        ),
    ],
)
def test_bad_arguments_exit_2(capsys, argv, message):
    code, lines, err = run(capsys, argv)
    assert code == 2
    assert lines == []
    assert message in err


def test_missing_required_argument_exits_2(capsys):
    assert main(["--task", "arithmetic"]) == 2
    assert "--input" in capsys.readouterr().err
