"""Loading prompts from JSONL and Parquet with a field mapping; malformed rows."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from groupflow.reward_workers.datasets import load_prompts, resolve_fields


def write_jsonl(path, lines):
    path.write_text(
        "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    )
    return path


def test_jsonl_with_mapping_and_nested_field(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"question": "1+1?", "meta": {"solution": "2"}, "id": 7},
            "",
            {"question": "2+2?", "meta": {"solution": "4"}},
        ],
    )
    loaded = load_prompts(path, {"prompt": "question", "answer": "meta.solution", "uid": "id"})
    assert [(p.uid, p.text, p.answer) for p in loaded.prompts] == [
        ("7", "1+1?", "2"),
        ("d.jsonl:3", "2+2?", "4"),
    ]
    assert loaded.skipped == 0


def test_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["a?", "b?"], "answer": ["1", "2"]}), path)
    loaded = load_prompts(path, {"prompt": "problem"})
    assert [(p.text, p.answer) for p in loaded.prompts] == [("a?", "1"), ("b?", "2")]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "q?"', "d.jsonl:2: not valid JSON"),
        ("[1, 2]", "d.jsonl:2: expected an object, got list"),
        ('{"solution": "4"}', "d.jsonl:2: field 'question' (prompt): missing"),
        ('{"question": "q?"}', "d.jsonl:2: field 'solution' (answer): missing"),
        ('{"question": "q?", "solution": null}', "d.jsonl:2: field 'solution' (answer): missing"),
        (
            '{"question": 5, "solution": "4"}',
            "d.jsonl:2: field 'question' (prompt): expected non-empty text, got 5",
        ),
        (
            '{"question": "  ", "solution": "4"}',
            "d.jsonl:2: field 'question' (prompt): expected non-empty text",
        ),
        (
            '{"question": "q?", "solution": "4", "uid": [1]}',
            "d.jsonl:2: field 'uid' (uid): expected text or an integer",
        ),
    ],
)
def test_malformed_row_stops_loading_with_one_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"question": "ok?", "solution": "1"}', line])
    with pytest.raises(ValueError) as err:
        load_prompts(path, {"prompt": "question", "answer": "solution"})
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    loaded = load_prompts(path, {"prompt": "question", "answer": "solution"}, skip_bad=True)
    assert [p.text for p in loaded.prompts] == ["ok?"]
    assert loaded.skipped == 1


def test_invalid_utf8_is_a_bad_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": 1}\n{"prompt": "\xff", "answer": 1}\n')
    with pytest.raises(ValueError, match="d.jsonl:2: not valid UTF-8"):
        load_prompts(path)
    assert load_prompts(path, skip_bad=True).skipped == 1


def test_parse_answer_failures_name_the_answer_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "x"}])

    def integer(raw):
        return int(raw)

    with pytest.raises(ValueError, match=r"d.jsonl:1: field 'answer' \(answer\): invalid literal"):
        load_prompts(path, parse_answer=integer)


def test_unicode_survives(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Σ of ½ + ½ 🙂?", "answer": "1"}])
    assert load_prompts(path).prompts[0].text == "Σ of ½ + ½ 🙂?"


def test_file_level_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_prompts(tmp_path / "d.csv")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="broken.parquet: not a readable Parquet file") as err:
        load_prompts(tmp_path / "broken.parquet")
    assert "\n" not in str(err.value)


def test_field_mapping_is_validated():
    assert resolve_fields({"prompt": "q"}) == {
        "prompt": "q",
        "messages": "messages",
        "answer": "answer",
        "uid": "uid",
    }
    with pytest.raises(ValueError, match="unknown key 'question'"):
        resolve_fields({"question": "q"})
    with pytest.raises(ValueError, match="must name a column"):
        resolve_fields({"prompt": ""})


def test_prompts_given_as_messages(tmp_path):
    turns = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "1+1?", "name": "ignored"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", [{"chat": turns, "answer": "2"}])
    (prompt,) = load_prompts(path, {"messages": "chat"}).prompts
    assert prompt.text == "" and prompt.answer == "2"
    assert prompt.messages == [{"role": t["role"], "content": t["content"]} for t in turns]


@pytest.mark.parametrize(
    ("chat", "message"),
    [
        ([], "expected a non-empty list of messages"),
        ("hi", "expected a non-empty list of messages"),
        ([{"role": "robot", "content": "x"}], "message 0: expected a role"),
        ([{"role": "user", "content": 3}], "message 0: content must be text"),
        ([{"role": "system", "content": "x"}], "no user message"),
    ],
)
def test_malformed_messages_name_the_field(tmp_path, chat, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"chat": chat, "answer": "2"}])
    with pytest.raises(ValueError, match=f"d.jsonl:1: field 'chat' \\(messages\\): {message}"):
        load_prompts(path, {"messages": "chat"})
    assert load_prompts(path, {"messages": "chat"}, skip_bad=True).skipped == 1


def test_a_task_instructs_the_last_user_turn_of_a_conversation(tmp_path):
    from groupflow.reward_workers.tasks import make_task

    def turns(i):
        return [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": f"What is 6*{i}?"},
        ]

    rows = [{"chat": turns(i), "answer": str(6 * i), "uid": i} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = make_task("math", {"dataset": str(path), "fields": {"messages": "chat"}})
    prompt = next(task.train_prompts(seed=0))
    i = int(prompt.uid)
    assert prompt.messages[:2] == turns(i)[:2]
    assert prompt.messages[2]["content"] == f"What is 6*{i}?\n{task.instruction}"
    assert rows[i]["chat"][2]["content"] == f"What is 6*{i}?"  # the rows are not changed
