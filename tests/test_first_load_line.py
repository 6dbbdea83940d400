"""The line a process prints at its first patched load (issue 52.7): once, on stderr, off with
``HF_PATCH_LOG`` set, never under pytest (the plugin) or from the ``hfpatch`` command itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hfpatch_core
from packs import MLP_PACK, PackSpec

# the line is hfpatch's logging around a plain llama load, which every release loads alike
pytestmark = pytest.mark.release_independent

_ROOT = Path(hfpatch_core.__file__).resolve().parents[1]
CHECKOUT = str(_ROOT) if (_ROOT / "pyproject.toml").is_file() else ""

PROGRAM = """
import sys
import hfpatch_core
from transformers import AutoModelForCausalLM

AutoModelForCausalLM.from_pretrained(sys.argv[1])  # before enable(): vanilla, nothing to say
hfpatch_core.enable(packs="mlp")
for _ in range(3):
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
print("the program's own output")
"""


def run_python(site: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_PATCH", "HFPATCH"))}
    environment["PYTHONPATH"] = os.pathsep.join(path for path in (str(site), CHECKOUT) if path)
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=environment, timeout=300, check=False
    )


def said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hfpatch: ")]


def test_the_first_patched_load_says_so_once_on_stderr(install, llama_checkpoint, tmp_path) -> None:
    site = install(PackSpec("mlp", MLP_PACK, version="1.2.0"))
    program = tmp_path / "train.py"
    program.write_text(textwrap.dedent(PROGRAM))
    plain = run_python(site, str(program), str(llama_checkpoint))
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == "the program's own output\n"  # stdout stays the program's
    (line,) = said(plain.stderr)
    assert line.startswith("hfpatch: LlamaForCausalLM: LlamaMLP <- PackMLP [mlp==1.2.0] (plan "), line
    quiet = run_python(site, str(program), str(llama_checkpoint), env={"HF_PATCH_LOG": "warning"})
    assert quiet.returncode == 0 and said(quiet.stderr) == [], quiet.stderr
    logged = run_python(site, str(program), str(llama_checkpoint), env={"HF_PATCH_LOG": "info"})
    assert logged.returncode == 0 and said(logged.stderr) == [line] * 3, logged.stderr  # the log, no line besides


INNER_TEST = """
import hfpatch_core
from transformers import AutoModelForCausalLM


def test_load(capfd):
    hfpatch_core.enable(packs="mlp")
    model = AutoModelForCausalLM.from_pretrained({checkpoint!r})
    assert type(model.model.layers[0].mlp).__name__ == "PackMLP"
    assert "hfpatch:" not in capfd.readouterr().err
"""


def test_pytest_runs_say_nothing(install, llama_checkpoint, tmp_path: Path) -> None:
    """Under pytest the line would land in whichever test loads first, where a test reading
    stderr gets it: the plugin keeps it off."""
    site = install(PackSpec("mlp", MLP_PACK))
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TEST.format(checkpoint=str(llama_checkpoint))))
    result = run_python(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_inner.py"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("command", [["explain", "llama"], ["verify", "mlp", "--model-type", "llama"]])
def test_the_hfpatch_command_says_what_applied_itself(install, command, capsys) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("mlp", MLP_PACK))
    from hfpatch_core._session import announcement

    was = announcement._said
    announcement._said = False  # as in a fresh process (the pytest plugin silenced this one)
    try:
        main(command)
        assert not [line for line in capsys.readouterr().err.splitlines() if "LlamaForCausalLM: LlamaMLP" in line]
        assert announcement._said is False  # the program's first patched load after the command still says it
    finally:
        announcement._said = was
