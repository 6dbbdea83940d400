"""The front door (issue 44): a selection in the environment is enough, and the forms users write work.

``HF_PATCH_PACKS=x python train.py`` enables hfpatch in a program that never names it, as ``hfpatch run``
does; ``none`` and unset change nothing.  Each case is a subprocess of this environment's Python, whose
site-packages holds the ``hfpatch_autorun.pth`` that hfpatch-core installs (tests/test_dist.py does the
same from a new virtual environment and the wheels).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from test_cli import HFPATCH, run

import hfpatch_core
from hfpatch_core.testing import tiny_config
from packs import MLP_PACK, PackSpec

#: a program that never names hfpatch, then reads what its loads got
PROGRAM = """
import sys, threading
from transformers import AutoModelForCausalLM
{before}
plans = []
def load():
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    plans.append(type(model.model.layers[0].mlp).__name__)
threads = [threading.Thread(target=load) for _ in range({threads})]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
if not threads:
    load()
print(*plans)
"""


def program(tmp_path: Path, *, before: str = "", threads: int = 0) -> str:
    """``train.py``: ``threads`` threads load at once, or (0) the main thread loads."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(PROGRAM).format(before=before, threads=threads))
    return str(path)


@pytest.fixture
def site(install) -> Path:
    return install(PackSpec("mlp", MLP_PACK))


@pytest.mark.release_independent
def test_the_variable_alone_enables_the_packs_in_every_thread(site, llama_checkpoint, tmp_path) -> None:
    # three threads' first loads at once: none may find transformers' loader between the stand-in and the wrapper
    script = program(tmp_path, threads=3)
    patched = run(sys.executable, script, str(llama_checkpoint), site=site, env={"HF_PATCH_PACKS": "mlp"})
    assert patched.returncode == 0, patched.stderr
    assert patched.stdout.split() == ["PackMLP"] * 3
    for env in ({}, {"HF_PATCH_PACKS": "none"}, {"HF_PATCH_PACKS": ""}):
        vanilla = run(sys.executable, script, str(llama_checkpoint), site=site, env=env)
        assert vanilla.returncode == 0, vanilla.stderr
        assert vanilla.stdout.split() == ["LlamaMLP"] * 3, env


@pytest.mark.release_independent
def test_a_lock_alone_enables_hfpatch(site, llama_checkpoint, tmp_path) -> None:
    written = run(HFPATCH, "lock", "-o", str(tmp_path / "hfpatch.lock"), site=site, env={"HF_PATCH_PACKS": "mlp"})
    assert written.returncode == 0, written.stderr
    locked = run(
        sys.executable,
        program(tmp_path),
        str(llama_checkpoint),
        site=site,
        env={"HF_PATCH_LOCK": str(tmp_path / "hfpatch.lock")},
    )
    assert locked.returncode == 0, locked.stderr
    assert locked.stdout.split() == ["PackMLP"]  # an unset HF_PATCH_PACKS under a lock is the lock's selection


@pytest.mark.release_independent
@pytest.mark.parametrize("launcher", [(), (HFPATCH, "run", "--")])
def test_hfpatch_core_imported_first(site, launcher) -> None:
    """Issue 44.2: importing hfpatch_core before transformers crashed with a circular import under autorun."""
    code = "import hfpatch_core; print(hfpatch_core.is_enabled())"
    for packs, enabled in (("mlp", True), ("none", bool(launcher)), (None, bool(launcher))):
        env = {} if packs is None else {"HF_PATCH_PACKS": packs}
        result = run(*launcher, sys.executable, "-c", code, site=site, env=env)
        assert result.returncode == 0, result.stderr
        # hfpatch run enables hfpatch whatever the selection; the variable alone, when it selects something
        assert result.stdout.split() == [str(enabled)], (launcher, packs)


@pytest.mark.release_independent
@pytest.mark.parametrize(
    ("before", "expected"),
    [
        ("import hfpatch_core.authoring, hfpatch_core.testing", "PackMLP"),
        ("import hfpatch_core; hfpatch_core.enable('none')", "LlamaMLP"),  # the program's own choice wins
        ("import hfpatch_core; hfpatch_core.disable()", "LlamaMLP"),
        ("import hfpatch_core\nwith hfpatch_core.enabled('none'):\n    pass", "PackMLP"),  # a block nests in it
    ],
)
def test_the_program_s_own_choice(site, llama_checkpoint, tmp_path, before: str, expected: str) -> None:
    script = program(tmp_path, before=before)
    result = run(sys.executable, script, str(llama_checkpoint), site=site, env={"HF_PATCH_PACKS": "mlp"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [expected]


@pytest.mark.release_independent
def test_a_pack_that_is_not_installed_is_the_first_load_s_error(site, llama_checkpoint, tmp_path) -> None:
    script = program(tmp_path)
    result = run(sys.executable, script, str(llama_checkpoint), site=site, env={"HF_PATCH_PACKS": "mpl"})
    assert result.returncode == 1
    assert "SelectionError: HF_PATCH_PACKS='mpl' names pack 'mpl', which is not installed" in result.stderr
    assert "Could not import module" not in result.stderr


@pytest.mark.release_independent
def test_the_hfpatch_command_is_not_enabled_by_the_variable(site, llama_checkpoint) -> None:
    """The command compares with vanilla loads of its own: the variable selects what it verifies, and no more."""
    code = (
        "import sys; from hfpatch_core.cli.console import main; import hfpatch_core; "
        "code = main(['list', '--no-conflicts']); print(hfpatch_core.is_enabled())"
    )
    result = run(sys.executable, "-c", code, site=site, env={"HF_PATCH_PACKS": "mlp"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"
    verified = run(HFPATCH, "verify", "mlp", "--model", str(llama_checkpoint), site=site, env={"HF_PATCH_PACKS": "mlp"})
    assert verified.returncode == 0, verified.stdout + verified.stderr


#: like most packs (fused-dense, linear-experts...), it decides from the config
CONFIG_READING_PACK = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaMLP

    class ConfiguredMLP(LlamaMLP):
        pass

    @hookimpl
    def provide_patches(context):
        if context.config is not None and context.config.hidden_act == "silu":
            return [Patch("LlamaMLP", ConfiguredMLP)]
        return []
"""


@pytest.mark.parametrize("build", ["LlamaForCausalLM", "LlamaModel", "LlamaForSequenceClassification"])
def test_patched_with_a_model_type_patches_every_class_built_in_it(install, monkeypatch, build: str) -> None:
    """Issue 44.3: ``patched("llama")`` planned without a config, so a pack that reads one claimed nothing (but
    did in the generic head's nested ``from_config``)."""
    import transformers

    install(PackSpec("configured", CONFIG_READING_PACK))  # first on sys.path until the test ends (conftest)
    hfpatch_core.enable("configured")
    config = tiny_config("llama")
    for form in ("llama", config):
        with hfpatch_core.patched(form) as plan:
            model = getattr(transformers, build)(config)
        base = getattr(model, "model", model)
        assert type(base.layers[0].mlp).__name__ == "ConfiguredMLP", form
        assert [claim.target for claim in plan.entries] == ["LlamaMLP"], form
    unknown = hfpatch_core.patched("lama")
    with pytest.raises(ValueError, match=r"patched\(\): 'lama' is not a model type of transformers .*'llama'"):
        unknown.__enter__()
    # the refused block left no session behind: a later block outside enable() reads HF_PATCH_PACKS
    hfpatch_core.disable()
    monkeypatch.setenv("HF_PATCH_PACKS", "none")
    with hfpatch_core.patched(config):
        assert type(transformers.LlamaModel(config).layers[0].mlp).__name__ == "LlamaMLP"
