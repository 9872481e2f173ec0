from groupflow.driver import fresh_run_dir


def test_an_earlier_run_is_kept_under_a_new_name(tmp_path):
    run = tmp_path / "quickstart"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert fresh_run_dir(run) == run
    assert list(run.iterdir()) == []
    (kept,) = [p for p in tmp_path.iterdir() if p != run]
    assert (
        kept.name.startswith("quickstart.")
        and (kept / "metrics.jsonl").read_text() == '{"step": 1}\n'
    )


def test_a_new_or_empty_directory_is_used_as_it_is(tmp_path):
    run = tmp_path / "a" / "b"
    assert fresh_run_dir(run) == run and run.is_dir()
    assert fresh_run_dir(run) == run and list(tmp_path.joinpath("a").iterdir()) == [run]
