"""The lint's line bound (`dev/function_size.py`, run by `make lint`)."""

from __future__ import annotations

from dev.function_size import main, too_long


def test_a_function_over_the_bound_is_named_and_fails_the_lint(tmp_path, capsys):
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "long.py").write_text(f"def fits():\n    return 1\n\n\ndef sprawls():\n{body}\n")
    assert too_long([str(tmp_path)], 60) == [f"{tmp_path / 'long.py'}:5 sprawls (61 lines > 60)"]
    assert main([str(tmp_path)]) == 1
    assert "sprawls" in capsys.readouterr().out
    assert main(["--max-lines", "61", str(tmp_path)]) == 0


def test_the_library_is_within_the_bound():
    assert too_long(["spark_jobs", "plugins", "dags"], 60) == []
