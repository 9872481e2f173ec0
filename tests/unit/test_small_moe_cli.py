"""`python -m groupflow.run.small_moe` and the model cache: bad input is one line, exit 2,
before any model is built."""

from __future__ import annotations

import pytest

from groupflow.core.errors import UserError
from groupflow.run import quickstart
from groupflow.run.quickstart import quickstart_model_path
from groupflow.run.small_moe import main


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--task", "nope"], "--task: unknown task 'nope'; choose one of ["),
        (["--warm-start-steps", "-5"], "--warm-start-steps: Input should be greater than or"),
        (["--warm-start-steps", str(1 << 70)], "--warm-start-steps: Value error, numbers must"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(argv, said, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GROUPFLOW_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"python -m groupflow.run.small_moe: error: {said}"), err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing built


@pytest.mark.parametrize("where", ["a-file", "a-file/below"])
def test_a_model_cache_that_cannot_hold_a_model_is_one_line_before_the_build(
    where, tmp_path, monkeypatch
):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("GROUPFLOW_CACHE", str(tmp_path / where))
    with pytest.raises(UserError, match=r"^the model cache \(GROUPFLOW_CACHE, else ~/\.cache/gr"):
        quickstart_model_path("arithmetic", {}, 1)


def test_a_build_that_another_process_finished_first_uses_that_model(tmp_path, monkeypatch):
    """Two processes build the same model at once: the second to finish takes the first's
    model (its rename onto the finished target fails) and leaves no partial build behind."""
    monkeypatch.setenv("GROUPFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(quickstart, "warm_start", lambda *args: None)
    publish = quickstart._publish

    def the_other_process_finishes_first(partial, target):
        target.mkdir()
        (target / "config.json").write_text("{}")  # theirs
        publish(partial, target)

    monkeypatch.setattr(quickstart, "_publish", the_other_process_finishes_first)
    small = dict(quickstart.ARCHITECTURE, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    path = quickstart_model_path("arithmetic", {}, 1, progress=False, shape=small)
    assert (path / "config.json").read_text() == "{}"
    assert list(tmp_path.iterdir()) == [path]  # our partial build removed
