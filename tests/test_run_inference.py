import pytest

import run_inference


def test_demo_runs_and_is_deterministic(capsys):
    assert run_inference.main(["--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "3"]) == 0
    first = capsys.readouterr().out
    assert "RANDOM weights" in first and "output ids:" in first
    run_inference.main(["--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "3"])
    second = capsys.readouterr().out
    line = [x for x in first.splitlines() if x.startswith("output ids:")]
    assert line and line[0] in second and len(line[0].split(":")[1].split(",")) == 3


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "99999"], "outside the demo model's vocabulary"),
    (["--max-new-tokens", "0"], "at least 1"),
])
def test_bad_arguments_exit_non_zero_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        run_inference.main(argv)
    assert info.value.code != 0
    assert message in capsys.readouterr().err
