"""What a newcomer runs after ``make demo`` (issue 52.6): the README's next commands, as printed.

``make demo`` installs hfpatch-core and the first-party packs into the site-packages of a venv of
its own (``.venv-demo``), then the demo prints the commands to run next.  The venv's libraries
(torch, transformers) take minutes to install, so the environment here is a fresh venv that reads
them from this interpreter's site-packages (a ``.pth``) and gets hfpatch-core and the packs from the
Makefile's own recipe (``$(VENV_DEMO)/.packs``); the README's lines then run in a shell, from the
directory that holds it, without ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hfpatch_core.cli.demo import next_steps

pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parent.parent

#: A program a newcomer runs with the pack (the README's ``train.py``): a tiny Qwen2-MoE from its config.
TRAIN = """
from transformers import AutoModelForCausalLM
from hfpatch_core.testing import tiny_config

model = AutoModelForCausalLM.from_config(tiny_config("qwen2_moe"))
print(type(model.model.layers[0].mlp.experts).__name__)
"""


def readme_next_steps() -> list[str]:
    """The console lines the README shows after ``make demo``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"After `make demo`.*?```console\n(?P<lines>.*?)```", text, re.S)
    assert block is not None, "README.md: no console block after 'After `make demo`'"
    return [line.removeprefix("$ ") for line in block["lines"].splitlines()]


def test_the_readme_shows_what_the_demo_prints() -> None:
    printed = next_steps(bin_dir=Path(".venv-demo/bin")).splitlines()
    assert printed[0] == "Next, with the packs installed in this environment (.venv-demo):"
    assert [line.strip() for line in printed[1:]] == readme_next_steps()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_readme_commands_after_the_demo_work_as_printed(tmp_path: Path) -> None:
    venv = tmp_path / ".venv-demo"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(
        sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    )  # the new venv's site-packages
    # torch, transformers, pip and hatchling from this environment, after the venv's own packages
    (site / "zz_libraries.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n", encoding="utf-8"
    )
    (venv / ".installed").touch()  # what the recipe of $(VENV_DEMO)/.installed would have made
    # a newcomer's shell: no hfpatch variable, no PYTHONPATH, and not inside `make core` (its job server)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HF_PATCH", "HFPATCH", "PYTHON")) and key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    }
    env["HF_PATCH_CACHE"] = str(tmp_path / "cache")
    made = subprocess.run(
        ["make", "--no-print-directory", f"VENV_DEMO={venv}", f"{venv}/.packs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    packs = sorted(path.name for path in site.glob("hfpatch_pack_*.dist-info"))
    assert len(packs) == 5, packs  # in the venv's site-packages, as pip install puts them

    (tmp_path / "train.py").write_text(TRAIN, encoding="utf-8")
    printed = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from hfpatch_core.cli.demo import next_steps; print(next_steps())"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = readme_next_steps()
    assert [line.strip() for line in printed.splitlines()[1:]] == lines  # what the demo prints there

    def shell(line: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        return result

    listed, explained, trained = (shell(line) for line in lines)
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[2:7]}
    assert sorted(rows) == ["chunked-loss", "fused-dense", "linear-experts", "moe-replay", "qwen-moe"], listed.stdout
    assert all(" enabled" in row for row in rows.values()), listed.stdout
    assert "PerExpertExperts [qwen-moe 0.1.0]" in explained.stdout, explained.stdout
    assert trained.stdout.strip() == "PerExpertExperts", trained.stderr
    assert "[qwen-moe==0.1.0]" in trained.stderr  # HF_PATCH_LOG=info: the plan's summary line
    # and without HF_PATCH_PACKS the same program runs vanilla: nothing enables hfpatch in it
    vanilla = shell(f"{venv.name}/bin/python train.py")
    assert vanilla.stdout.strip() == "Qwen2MoeExperts", vanilla.stderr
