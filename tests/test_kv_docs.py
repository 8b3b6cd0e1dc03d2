"""docs/kv-cache.md stays true: its engine-step example runs and its figures match."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "kv-cache.md"


def test_engine_step_example_runs():
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    assert namespace["manager"].get_num_free_blocks() == 63


def test_capacity_figures_in_the_doc_match_the_cli(capsys):
    from pagedkv.cli import main

    text = DOC.read_text()
    commands = re.findall(r"^\$ (pagedkv capacity .*?)\n(?=quantity)", text, re.M | re.S)
    assert len(commands) == 2
    for command in commands:
        argv = command.replace("\\\n", " ").split()[1:]
        assert main(argv) == 0
        for line in capsys.readouterr().out.splitlines():
            assert line.rstrip() in text, line
