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
    assert resolve_fields({"prompt": "q"}).columns == {
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


# ----- the train/held-out split ----------------------------------------------------------------
def conversation(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is {i}*7?"},
    ]


def split_uids(task) -> tuple[set[str], set[str]]:
    return {p.uid for p in task.pool.train}, {p.uid for p in task.pool.held_out}


def math_task(path, **options):
    from groupflow.reward_workers.tasks import make_task

    return make_task("math", {"dataset": str(path), "fields": {"messages": "chat"}, **options})


def test_messages_only_rows_split_into_both_sides_the_same_every_time(tmp_path):
    rows = [{"chat": conversation(i), "answer": str(7 * i), "uid": i} for i in range(200)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train, held_out = split_uids(math_task(path))
    assert train and held_out and not train & held_out
    assert len(train | held_out) == 200
    assert 5 <= len(held_out) <= 40  # about eval_fraction = 0.1 of them
    # Another load, rows reordered and others added: each row keeps its side.
    more = [{"chat": conversation(i), "answer": "0", "uid": i} for i in range(200, 300)]
    again = write_jsonl(tmp_path / "again.jsonl", more + rows[::-1])
    train_again, held_again = split_uids(math_task(again))
    assert train <= train_again and held_out <= held_again


def test_the_split_is_the_same_in_another_process(tmp_path):
    import subprocess
    import sys

    rows = [{"chat": conversation(i), "answer": str(i), "uid": i} for i in range(100)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    script = (
        "import sys; from groupflow.reward_workers.tasks.prompt_pool import PromptPool\n"
        "pool = PromptPool.from_dataset('t', sys.argv[1], eval_dataset=None, "
        "fields={'messages': 'chat'}, skip_bad=False, eval_fraction=0.1, parse_answer=str)\n"
        "print(sorted(p.uid for p in pool.held_out))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout
    assert out.strip() == str(sorted(split_uids(math_task(path))[1]))


@pytest.mark.parametrize(
    "rows",
    [
        # duplicates: two conversations, fifteen copies each
        [{"chat": conversation(i % 2), "answer": "1", "uid": i} for i in range(30)],
        # two rows
        [{"chat": conversation(i), "answer": "1", "uid": i} for i in range(2)],
        # text rows and conversations, a text row the same prompt as a lone user turn
        [{"prompt": f"q{i}", "answer": "1", "uid": f"t{i}"} for i in range(10)]
        + [
            {"chat": [{"role": "user", "content": f"q{i}"}], "answer": "1", "uid": f"m{i}"}
            for i in range(10)
        ]
        + [{"chat": conversation(i), "answer": "1", "uid": f"c{i}"} for i in range(10)],
        # a lone surrogate in a prompt
        [{"prompt": f"q{i}\ud800", "answer": "1", "uid": i} for i in range(5)],
    ],
    ids=["duplicates", "two-rows", "text-and-messages", "lone-surrogate"],
)
@pytest.mark.parametrize("eval_fraction", [0.001, 0.1, 0.999])
def test_a_split_has_both_sides_and_never_splits_one_prompt(tmp_path, rows, eval_fraction):
    from groupflow.reward_workers.tasks.prompt_pool import split_key

    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = math_task(path, eval_fraction=eval_fraction, instruction="")
    train, held_out = task.pool.train, task.pool.held_out
    assert train and held_out and len(train) + len(held_out) == len(rows)
    assert not {split_key(p) for p in train} & {split_key(p) for p in held_out}


@pytest.mark.parametrize(
    "rows",
    [
        [{"chat": conversation(1), "answer": "7"}],
        [{"chat": conversation(1), "answer": "7"}] * 20,
        [
            {"prompt": "q", "answer": "1"},
            {"chat": [{"role": "user", "content": "q"}], "answer": "1"},
        ],
    ],
    ids=["one-row", "one-prompt-twenty-times", "one-prompt-as-text-and-turn"],
)
def test_a_dataset_of_one_prompt_is_refused_in_one_line(tmp_path, rows):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"math: no held-out prompts to evaluate on in .*d.jsonl"
    ) as err:
        math_task(path)
    assert "\n" not in str(err.value)


def test_an_eval_dataset_of_conversations_holds_out_only_its_own(tmp_path):
    rows = [{"chat": conversation(i), "answer": "1", "uid": i} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    eval_path = write_jsonl(tmp_path / "e.jsonl", rows[:3])
    train, held_out = split_uids(math_task(path, eval_dataset=str(eval_path)))
    assert train == {str(i) for i in range(3, 10)} and held_out == {"0", "1", "2"}


def test_an_empty_eval_dataset_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "1"}] * 3)
    eval_path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "bad"}])
    with pytest.raises(ValueError, match="no held-out prompts to evaluate on in .*e.jsonl"):
        math_task(path, eval_dataset=str(eval_path), skip_bad=True)


@pytest.mark.parametrize("skip", ["d.jsonl:1", [1], {"d.jsonl:1": True}])
def test_skip_prompts_must_be_a_list_of_uids(tmp_path, skip):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": "1"} for i in range(3)])
    # refused by the option's declared type (Sequence[str]) before the task is built
    with pytest.raises(ValueError, match=r"^task\.options\.skip_prompts(\[0\])?: "):
        math_task(path, skip_prompts=skip)


# ----- gold answers cut out of worked solutions (reward_workers/gold_answers.py) ----------------
GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 friends in April, and half as many in May. How many?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nAltogether 48+24 = <<48+24=72>>72.\n"
        "#### 72",
        "id": "a",
    },
    {
        "question": "A farm has 1,200 hens and buys 34 more. How many hens?",
        "answer": "1,200 + 34 = 1,234 hens (#### is not the end).\n#### 1,234",
        "id": "b",
    },
]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("write", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # gsm8k: the text after the last ####, without the commas inside numbers
        ("gsm8k", ["72", "1234"]),
        ({"prompt": "question", "uid": "id", "answer_format": "gsm8k"}, ["72", "1234"]),
        # a pattern: its last match, group 1, else the whole match
        ({"prompt": "question", "answer_regex": r"####\s*([\d,]+)"}, ["72", "1,234"]),
        ({"prompt": "question", "answer_regex": r"(?m)^#### .*$"}, ["#### 72", "#### 1,234"]),
    ],
)
def test_the_gold_answer_is_cut_out_of_a_worked_solution(tmp_path, write, fields, expected):
    path = write(tmp_path / f"gsm.{'jsonl' if write is write_jsonl else 'parquet'}", GSM8K_ROWS)
    assert [p.answer for p in load_prompts(path, fields).prompts] == expected


def test_the_gsm8k_preset_maps_question_and_answer(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    mapping = resolve_fields("gsm8k")
    assert (mapping.columns["prompt"], mapping.columns["answer"]) == ("question", "answer")
    prompt = load_prompts(path, "gsm8k").prompts[0]
    assert (prompt.text, prompt.uid) == (GSM8K_ROWS[0]["question"], "gsm.jsonl:1")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"answer_regex": "(#+"}, r"dataset fields: answer_regex '\(#\+' is not a valid regular"),
        ({"answer_regex": ""}, "dataset fields: answer_regex must be a regular expression"),
        ({"answer_format": "gsm9k"}, "dataset fields: answer_format 'gsm9k' is unknown; use gsm8k"),
        (
            {"answer_format": "gsm8k", "answer_regex": "x"},
            "answer_format or answer_regex, not both",
        ),
        ("gsm9k", "dataset fields: unknown preset 'gsm9k'; use gsm8k"),
        (["question"], "dataset fields: expected a mapping or a preset name"),
        ({"answer_fmt": "gsm8k"}, "unknown key 'answer_fmt'; use prompt, .*answer_regex"),
    ],
)
def test_bad_answer_extraction_settings_are_one_line_naming_the_key(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve_fields(fields)
    assert "\n" not in str(err.value)


def test_a_row_whose_answer_cannot_be_cut_stops_loading_or_is_skipped(tmp_path):
    rows = [*GSM8K_ROWS, {"question": "q?", "answer": "no marker"}, {"question": "r?", "answer": 5}]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    with pytest.raises(ValueError, match=r"gsm.jsonl:3: field 'answer' \(answer\): answer_format "):
        load_prompts(path, "gsm8k")
    loaded = load_prompts(path, "gsm8k", skip_bad=True)
    assert ([p.answer for p in loaded.prompts], loaded.skipped) == (["72", "1234"], 2)
    with pytest.raises(ValueError, match="gsm.jsonl:4: .*needs text, got int"):
        load_prompts(path, {"answer_regex": r"\w+", "prompt": "question"})
