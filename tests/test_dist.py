"""``make dist`` and installing from its wheelhouse: what a user does while nothing is on the index.

The wheels are installed into a new virtual environment of their own (``venv --without-pip``,
not ``--system-site-packages``): hfpatch-core and the pack land in its site-packages, and the
demo must import them from there.  Only the heavy third-party requirements (torch,
transformers and what they need) are lent from this test environment, one link per
distribution in a directory of their own, so that nothing is downloaded and this checkout's
hfpatch-core (installed editable here) stays out of sight.
"""

from __future__ import annotations

import dataclasses
import email.parser
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import importlib_metadata
import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.release_independent

REPOSITORY = Path(__file__).resolve().parent.parent
PACK = "hfpatch-pack-qwen-moe"


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", requirement).lower()


def wheel_requirements(wheel: Path) -> list[str]:
    """The unconditional ``Requires-Dist`` names of a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    requirements = [Requirement(text) for text in message.get_all("Requires-Dist") or ()]
    return [r.name for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def third_party_closure(roots: list[str]) -> list[importlib_metadata.Distribution]:
    """The distributions installed here that ``roots`` need, transitively, except hfpatch's own."""
    found: dict[str, importlib_metadata.Distribution] = {}
    pending = [name for name in roots if not _name(name).startswith("hfpatch")]
    while pending:
        name = _name(pending.pop())
        if name in found:
            continue
        distribution = found[name] = importlib_metadata.distribution(name)
        for text in distribution.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return list(found.values())


def lend(distributions: list[importlib_metadata.Distribution], directory: Path) -> None:
    """Link each distribution's top-level files (packages, modules, its .dist-info) into ``directory``."""
    directory.mkdir()
    for distribution in distributions:
        base = Path(distribution.locate_file(""))
        tops = {Path(file).parts[0] for file in distribution.files or () if not str(file).startswith("..")}
        for top in sorted(tops):
            source, link = base / top, directory / top
            if source.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(source)


def bare_environment() -> dict[str, str]:
    """This environment's variables without what would put this checkout or its packs on the path."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_ADDOPTS")
    return {
        key: value
        for key, value in os.environ.items()
        if key not in dropped and not key.startswith(("HF_PATCH", "HFPATCH", "PIP_"))
    }


@dataclasses.dataclass(frozen=True)
class Environment:
    """A new virtual environment with hfpatch-core and the qwen-moe pack installed from the wheelhouse."""

    venv: Path
    purelib: Path
    cwd: Path

    def run(self, *command: str | Path, **variables: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(map(str, command)),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=self.cwd,
            env={**bare_environment(), "USE_HUB_KERNELS": "0", **variables},
        )

    def python(self, code: str, **variables: str) -> subprocess.CompletedProcess[str]:
        return self.run(self.venv / "bin" / "python", "-c", code, **variables)


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> Environment:
    """``make dist``, then ``pip install --find-links dist hfpatch-pack-qwen-moe`` into a new venv."""
    tmp_path = tmp_path_factory.mktemp("dist")
    if shutil.which("make") is None:
        pytest.fail("make is not installed; the wheelhouse is built by `make dist`")
    wheelhouse = tmp_path / "dist"
    # this environment's python and hatchling; -o: the environment is not rebuilt
    built = subprocess.run(
        ["make", "-o", f"{sys.prefix}/.installed", "dist", f"VENV={sys.prefix}", f"DIST={wheelhouse}"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
        # not the flags of a `make unit` this suite may run under (its job server, -n, -k)
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    wheels = sorted(path.name.split("-")[0] for path in wheelhouse.glob("*.whl"))
    packs = sorted(path.name.replace("-", "_") for path in (REPOSITORY / "plugins").glob("hfpatch-pack-*"))
    assert wheels == sorted(["hfpatch_core", *packs])

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=bare_environment(),
    ).stdout.strip()
    assert Path(purelib).is_relative_to(venv) and purelib != sysconfig.get_paths()["purelib"]
    lent = tmp_path / "third-party"
    needed = [name for wheel in wheelhouse.glob("*.whl") for name in wheel_requirements(wheel)]
    lend(third_party_closure(needed), lent)
    assert not any(path.name.startswith(("hfpatch", "_hfpatch")) for path in lent.iterdir())
    (Path(purelib) / "third-party.pth").write_text(f"{lent}\n")

    made = Environment(venv, Path(purelib), tmp_path)
    install = made.run(sys.executable, "-m", "pip", "--python", python, "install", "--disable-pip-version-check",
                       "-q", "--no-index", "--find-links", wheelhouse, PACK)  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    return made


def test_the_wheelhouse_installs_into_a_new_environment_and_the_demo_passes(environment: Environment) -> None:
    purelib = environment.purelib
    installed = sorted(path.name.split("-")[0] for path in purelib.glob("*.dist-info"))
    assert installed == ["hfpatch_core", "hfpatch_pack_qwen_moe"]  # the requirements were met by the lent ones
    where = environment.python(
        "import hfpatch_core, hfpatch_pack_qwen_moe as p; print(hfpatch_core.__file__, p.__file__)"
    )
    assert where.returncode == 0, where.stderr
    assert all(Path(path).is_relative_to(purelib) for path in where.stdout.split()), where.stdout

    demo = environment.run(environment.venv / "bin" / "hfpatch", "demo")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "qwen-moe 0.1.0" in demo.stdout and "FAIL" not in demo.stdout, demo.stdout
    assert demo.stdout.count("PASS") == 5, demo.stdout


#: a program that never names hfpatch: what the pack did to its model, read from outside
TRAIN = """
import sys
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
experts = type(model.model.layers[0].mlp.experts).__name__
plan = sys.modules["hfpatch_core"].plan_of(model) if "hfpatch_core" in sys.modules else None
print(experts, plan.summary() if plan else None)
"""

#: what start-up imported, in a program that imports nothing itself
IMPORTED = (
    "import sys; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'hfpatch_core', "
    "'_hfpatch_autorun'}))"
)


def test_the_environment_variable_alone_enables_the_pack(environment: Environment) -> None:
    """Issue 44.1: ``HF_PATCH_PACKS=qwen-moe python train.py``, and train.py never names hfpatch."""
    checkpoint = environment.cwd / "qwen2_moe"
    saved = environment.python(
        f"from hfpatch_core.testing import tiny_checkpoint; tiny_checkpoint('qwen2_moe', {str(checkpoint)!r})"
    )
    assert saved.returncode == 0, saved.stderr
    script = environment.cwd / "train.py"
    script.write_text(TRAIN)
    python = environment.venv / "bin" / "python"

    patched = environment.run(python, script, checkpoint, HF_PATCH_PACKS="qwen-moe")
    assert patched.returncode == 0, patched.stderr
    assert "[qwen-moe==0.1.0]" in patched.stdout and not patched.stdout.startswith("Qwen2MoeExperts"), patched.stdout
    for variables in ({}, {"HF_PATCH_PACKS": "none"}, {"HF_PATCH_PACKS": " "}):
        vanilla = environment.run(python, script, checkpoint, **variables)
        assert vanilla.returncode == 0, vanilla.stderr
        assert vanilla.stdout.split() == ["Qwen2MoeExperts", "None"], (variables, vanilla.stdout)

    # unset or none: start-up imports nothing; set, only its hook, until the program imports transformers
    for variables, imported in (
        ({}, []),
        ({"HF_PATCH_PACKS": "none"}, []),
        ({"HF_PATCH_PACKS": "qwen-moe"}, ["_hfpatch_autorun"]),
    ):
        started = environment.python(IMPORTED, **variables)
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip() == repr(imported), (variables, started.stdout)

    # a pack that is not installed is the first load's error, with the selection's own message
    typo = environment.run(python, script, checkpoint, HF_PATCH_PACKS="qwen-mo")
    assert typo.returncode == 1
    assert "SelectionError: HF_PATCH_PACKS='qwen-mo' names pack 'qwen-mo', which is not installed" in typo.stderr
