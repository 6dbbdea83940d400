"""``hfpatch new`` end to end: generate pack projects, install them, run their tests and the CLI."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cookiecutter.exceptions import FailedHookException
from cookiecutter.main import cookiecutter

from hfpatch_core.cli.scaffold import REPORT_ENV, ScaffoldError, new_pack, template_path, template_variables
from hfpatch_core.errors import HfPatchError

pytestmark = pytest.mark.release_independent

HFPATCH = str(Path(sys.executable).with_name("hfpatch"))
REPOSITORY = Path(__file__).resolve().parent.parent


def tool(name: str) -> str:
    """An executable of this test environment (next to its python), else from PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed in the test environment ({sys.executable}); pip install {name}"
    return found


def run(*args: str, site: Path | None = None, env: dict[str, str] | None = None, timeout: int = 300):
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HF_PATCH", "HFPATCH", "PYTEST_ADDOPTS", "COOKIECUTTER"))
    }
    environment["PYTHONPATH"] = str(site) if site else ""
    environment.update(env or {})
    return subprocess.run(args, capture_output=True, text=True, env=environment, timeout=timeout, check=False)


def _cookiecutter_config(directory: Path) -> Path:
    """A cookiecutter user config that keeps replay files out of the home directory."""
    config = directory / "cookiecutter.yaml"
    config.write_text(f"cookiecutters_dir: {directory / 'cookiecutters'}\nreplay_dir: {directory / 'replay'}\n")
    return config


@pytest.fixture(autouse=True)
def _isolated_cookiecutter(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COOKIECUTTER_CONFIG", str(_cookiecutter_config(tmp_path_factory.mktemp("cookiecutter"))))
    monkeypatch.delenv(REPORT_ENV, raising=False)


@dataclasses.dataclass(frozen=True)
class Generated:
    projects: dict[str, Path]  # pack name -> project directory
    site: Path  # where both are pip-installed


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Generated]:
    """Two projects: the defaults (no_input) and answers typed at the prompts; pip-installed."""
    root = tmp_path_factory.mktemp("scaffold")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COOKIECUTTER_CONFIG", str(_cookiecutter_config(root)))
        default = new_pack(no_input=True, output_dir=root / "projects")
        # pack_name, project_slug, module_name, variant, model_type, target_class, description,
        # author, transformers_range: the empty lines accept the defaults.
        answers = 'fast-mlp\n\n\n\nqwen2\nQwen2MLP\nA "fast" Qwen2 MLP\nAda Lovelace\n\n'
        patch.setattr(sys, "stdin", io.StringIO(answers))
        custom = new_pack(output_dir=root / "projects")
    assert default == root / "projects" / "hfpatch-pack-my-pack"
    assert custom == root / "projects" / "hfpatch-pack-fast-mlp"
    site = root / "site"
    install = run(
        sys.executable,
        *("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--disable-pip-version-check", "-q"),
        *("--target", str(site), str(default), str(custom)),
    )
    assert install.returncode == 0, (
        f"pip install of the generated projects failed (with --no-build-isolation the test environment "
        f"needs hatchling):\n{install.stdout}\n{install.stderr}"
    )
    yield Generated({"my-pack": default, "fast-mlp": custom}, site)


def test_template_is_found_in_the_checkout() -> None:
    template = template_path()
    assert template == REPOSITORY / "cookiecutter-template"
    assert (template / "hooks" / "pre_gen_project.py").is_file()
    assert (template / "{{cookiecutter.project_slug}}").is_dir()
    assert list(template_variables()) == [
        "pack_name",
        "project_slug",
        "module_name",
        "variant",
        "model_type",
        "target_class",
        "description",
        "author",
        "transformers_range",
    ]


def test_generated_projects_have_the_pack_layout(generated: Generated) -> None:
    expected = {
        "my-pack": ("hfpatch_pack_my_pack", "llama", "LlamaMLP", "hfpatch pack replacing LlamaMLP in llama models"),
        "fast-mlp": ("hfpatch_pack_fast_mlp", "qwen2", "Qwen2MLP", 'A "fast" Qwen2 MLP'),
    }
    installed = {dist.metadata["Name"]: dist for dist in importlib.metadata.distributions(path=[str(generated.site)])}
    assert sorted(installed) == ["hfpatch-pack-fast-mlp", "hfpatch-pack-my-pack"]
    for pack, (module, model_type, target, description) in expected.items():
        project = generated.projects[pack]
        files = sorted(str(path.relative_to(project)) for path in project.rglob("*") if path.is_file())
        assert files == [
            ".github/workflows/release.yml",
            ".github/workflows/tests.yml",
            ".gitignore",
            "README.md",
            "compat.py",
            f"{module}/__init__.py",
            f"{module}/hfpatch-record.json",
            f"{module}/py.typed",
            "pyproject.toml",
            "tests/test_pack.py",
        ]
        assert 'build-backend = "hatchling.build"' in (project / "pyproject.toml").read_text()
        metadata = installed[f"hfpatch-pack-{pack}"]
        assert metadata.version == "0.1.0"
        assert metadata.metadata["Summary"] == description
        assert metadata.requires == [
            "hfpatch-core>=0.1",
            "torch",
            "transformers<6,>=5.3",
            "pytest>=7; extra == 'test'",
        ]
        assert [(point.group, point.name, point.value) for point in metadata.entry_points] == [
            ("hfpatch.packs", pack, module)
        ]
        source = (project / module / "__init__.py").read_text()
        assert f"from transformers.models.{model_type}.modeling_{model_type} import {target}\n" in source
        assert f"class Patched{target}({target}):" in source
        assert "@hookimpl\ndef provide_patches(context: LoadContext) -> list[Patch]:" in source
        assert "# def provide_converters(context: LoadContext) -> list[Converter]:" in source
        assert "SizedConcatenate(dim=0" in source and "WeightConverter(" in source
        test = (project / "tests" / "test_pack.py").read_text()
        assert f'PACK = "{pack}"\nMODEL_TYPE = "{model_type}"\nTARGET = "{target}"\n' in test
        # the replacement's name comes from the pack: renaming the class needs no change here
        assert f"from {module} import REPLACEMENT\n" in test and f"Patched{target}" not in test
        assert f"\nREPLACEMENT = Patched{target}\n" in source
        assert "assert_pack_equivalent(PACK, MODEL_TYPE, expected_replacements=[TARGET])" in test
        assert "assert_pack_equivalent(PACK, MODEL_TYPE, generate_tokens=0, train_steps=5)" in test
        workflow = (project / ".github" / "workflows" / "tests.yml").read_text()
        for needed in ('python-version: "3.11"', "download.pytorch.org/whl/cpu", 'pip install -e ".[test]"', "pytest"):
            assert needed in workflow
        release = (project / ".github" / "workflows" / "release.yml").read_text()
        for needed in (
            "twine check --strict",
            f"hfpatch verify {pack}\n",
            "pypa/gh-action-pypi-publish",
            "id-token: write",
        ):
            assert needed in release
        readme = (project / "README.md").read_text()
        for needed in ("HF_PATCH_PACKS", f"`-{pack}`", "hfpatch list", f"hfpatch check {pack}", "hfpatch explain"):
            assert needed in readme
        assert "python -m build" in readme and "twine upload" in readme
    assert installed["hfpatch-pack-fast-mlp"].metadata.get("Author") == "Ada Lovelace"
    assert installed["hfpatch-pack-my-pack"].metadata.get("Author") is None


def test_generated_projects_are_ruff_clean(generated: Generated) -> None:
    projects = [str(path) for path in generated.projects.values()]
    lint = run(tool("ruff"), "check", "--no-cache", *projects)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    layout = run(tool("ruff"), "format", "--check", "--no-cache", *projects)
    assert layout.returncode == 0, layout.stdout + layout.stderr


def test_generated_record_lists_the_target_on_this_transformers(generated: Generated) -> None:
    import transformers

    record = json.loads((generated.projects["fast-mlp"] / "hfpatch_pack_fast_mlp" / "hfpatch-record.json").read_text())
    assert record == {
        "format": 1,
        "pack": "fast-mlp",
        "releases": {
            transformers.__version__: [
                {"model_type": "qwen2", "class": "Qwen2MLP", "forward": "(self, x)", "__init__": "(self, config)"}
            ]
        },
    }


def test_generated_compat_command_checks_the_current_release(generated: Generated) -> None:
    import transformers

    project = generated.projects["my-pack"]
    usage = run(sys.executable, str(project / "compat.py"), "--help", site=generated.site)
    assert usage.returncode == 0 and "RELEASE" in usage.stdout and "--pip" in usage.stdout
    version = transformers.__version__  # installed already: nothing is installed, only checked
    result = run(sys.executable, str(project / "compat.py"), version, "--steps", "check", "verify", site=generated.site)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-3:] == [
        "| transformers | check | verify |",
        "|---|---|---|",
        f"| {version} | ok | ok |",
    ]


@pytest.mark.parametrize("pack", ["my-pack", "fast-mlp"])
def test_generated_tests_pass_once_installed(generated: Generated, pack: str) -> None:
    project = generated.projects[pack]
    tests = str(project / "tests")
    result = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests, site=generated.site)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed, 1 deselected" in result.stdout  # the distributed test is opt-in


def test_generated_distributed_test_proves_the_pack_on_two_ranks(generated: Generated) -> None:
    """``pytest -m distributed``: one torchrun of 2 ranks (the default project: a llama MLP subclass)."""
    tests = str(generated.projects["my-pack"] / "tests")
    options = ("-q", "-p", "no:cacheprovider", "-m", "distributed")
    result = run(sys.executable, "-m", "pytest", *options, tests, site=generated.site, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 2 deselected" in result.stdout


def test_installed_packs_are_listed_checked_and_can_be_disabled(generated: Generated) -> None:
    listed = run(HFPATCH, "list", "--json", site=generated.site)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)["packs"]}
    for pack in generated.projects:
        assert rows[pack]["enabled"] and rows[pack]["status"] == "enabled"
        assert rows[pack]["distribution"] == f"hfpatch-pack-{pack}" and rows[pack]["version"] == "0.1.0"
        assert rows[pack]["transformers"] == "<6,>=5.3"
    assert rows["fast-mlp"]["description"] == 'A "fast" Qwen2 MLP'

    checked = run(HFPATCH, "check", "my-pack", "fast-mlp", site=generated.site)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # the drift record generated with the project ships in its wheel and matches this transformers
    assert checked.stdout.splitlines() == [
        "ok    fast-mlp 0.1.0: targets qwen2",
        "ok    my-pack 0.1.0: targets llama",
        "ok    together: fast-mlp, my-pack",
    ]

    disabled = run(HFPATCH, "list", "--json", site=generated.site, env={"HF_PATCH_PACKS": "-fast-mlp"})
    assert disabled.returncode == 0, disabled.stderr
    rows = {row["name"]: row for row in json.loads(disabled.stdout)["packs"]}
    assert not rows["fast-mlp"]["enabled"]
    assert rows["fast-mlp"]["status"] == "disabled: excluded by HF_PATCH_PACKS='-fast-mlp'"
    assert rows["my-pack"]["enabled"]


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        (
            {"name": "Bad Name!"},
            "pack_name 'Bad Name!' is not a valid pack name: use lowercase letters, digits, '-', '.' and '_', "
            "starting and ending with a letter or digit (e.g. 'bad-name').",
        ),
        (
            {"model_type": "lama"},
            "model_type 'lama' is not a model type transformers {version} knows; did you mean 'llama'",
        ),
        (
            {"target": "LlamaMPL"},
            "target_class 'LlamaMPL' is not defined in transformers.models.llama.modeling_llama; "
            "did you mean 'LlamaMLP'",
        ),
    ],
    ids=["pack-name", "model-type", "target-class"],
)
def test_bad_answers_are_one_error_and_leave_nothing(tmp_path: Path, answers: dict[str, str], expected: str) -> None:
    import transformers

    output = tmp_path / "new" / "packs"
    with pytest.raises(ScaffoldError) as caught:
        new_pack(no_input=True, output_dir=output, **answers)
    message = str(caught.value)
    assert isinstance(caught.value, HfPatchError)
    assert message.startswith("the pack template rejected the answers: ")
    assert expected.format(version=transformers.__version__) in message
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []  # not even the output directory it created


def test_every_bad_answer_is_reported_at_once(tmp_path: Path) -> None:
    """A misspelt model type does not hide a misspelt target class: it is checked against the closest type."""
    import transformers

    with pytest.raises(ScaffoldError) as caught:
        new_pack("Bad Name", model_type="lama", target="LlamaMPL", no_input=True, output_dir=tmp_path / "out")
    message = str(caught.value)
    expected = [
        "pack_name 'Bad Name' is not a valid pack name",
        f"model_type 'lama' is not a model type transformers {transformers.__version__} knows; did you mean 'llama'",
        "for the closest model type, 'llama': target_class 'LlamaMPL' is not defined in "
        "transformers.models.llama.modeling_llama; did you mean 'LlamaMLP'",
    ]
    assert all(part in message for part in expected), message
    assert "\n" not in message and list(tmp_path.iterdir()) == []
    # the default target follows the model type: a wrong type is not reported twice
    with pytest.raises(ScaffoldError) as default:
        new_pack(model_type="lama", no_input=True, output_dir=tmp_path / "out")
    assert "target_class" not in str(default.value)


def test_cookiecutter_itself_removes_a_rejected_project(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FailedHookException):
        cookiecutter(
            str(template_path()), no_input=True, extra_context={"model_type": "lama"}, output_dir=str(tmp_path)
        )
    assert list(tmp_path.iterdir()) == []
    assert "error: model_type 'lama' is not a model type transformers" in capfd.readouterr().err


def test_an_existing_project_directory_is_left_alone(tmp_path: Path) -> None:
    existing = tmp_path / "hfpatch-pack-my-pack"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep me")
    with pytest.raises(ScaffoldError, match="hfpatch-pack-my-pack already exists; remove it"):
        new_pack("my-pack", no_input=True, output_dir=tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == ["hfpatch-pack-my-pack"]
    assert [path.name for path in existing.iterdir()] == ["mine.txt"]


def test_unknown_template_variables_are_rejected_before_generating(tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match="unknown template variable 'colour'; the pack template asks for pack_name"):
        new_pack(no_input=True, output_dir=tmp_path / "out", extra_context={"colour": "blue"})
    assert list(tmp_path.iterdir()) == []


def test_generated_projects_hold_no_bytecode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip byte-compiles the installed template's valid Python files; the project gets none of it."""
    template = tmp_path / "template"
    shutil.copytree(template_path(), template)
    for folder in ("{{cookiecutter.project_slug}}", "{{cookiecutter.project_slug}}/tests"):
        cache = template / folder / "__pycache__"
        cache.mkdir()
        (cache / "compat.cpython-311.pyc").write_bytes(b"compiled")
    (template / "{{cookiecutter.project_slug}}" / "stray.pyc").write_bytes(b"compiled")
    monkeypatch.setattr("hfpatch_core.cli.scaffold.template_path", lambda: template)
    project = new_pack(no_input=True, output_dir=tmp_path / "out")
    assert (project / "compat.py").is_file()
    assert [path for path in project.rglob("*") if path.name == "__pycache__" or path.suffix in (".pyc", ".pyo")] == []


def test_structural_project_starts_from_the_example_and_passes_its_tests(tmp_path: Path) -> None:
    """``hfpatch new --structural``: the docs' rms-norm example under the pack's name, its tests passing."""
    created = run(HFPATCH, "new", "norms", "--structural", "--no-input", "-o", str(tmp_path / "projects"))
    assert created.returncode == 0, created.stdout + created.stderr
    project = tmp_path / "projects" / "hfpatch-pack-norms"
    module = (project / "hfpatch_pack_norms" / "__init__.py").read_text()
    example = (REPOSITORY / "docs" / "examples" / "rms-norm" / "hfpatch_pack_rms_norm.py").read_text()
    # the same module, under the project's one-line description
    assert module.splitlines()[0].startswith('"""hfpatch pack replacing every RMS norm')
    assert module.splitlines()[1:] == example.splitlines()[1:]
    assert "import hfpatch_pack_norms as pack" in (project / "tests" / "test_pack.py").read_text()
    lint = run(tool("ruff"), "check", "--no-cache", str(project))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    site = tmp_path / "site"
    install = run(
        sys.executable,
        *("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--disable-pip-version-check", "-q"),
        *("--target", str(site), str(project)),
    )
    assert install.returncode == 0, install.stdout + install.stderr
    result = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(project / "tests"), site=site)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed, 1 deselected" in result.stdout


def test_structural_project_says_what_it_is_and_passes_its_check(tmp_path: Path) -> None:
    """Every word of the structural project is about the structural pack (not the class variant's
    ``LlamaMLP``), and ``hfpatch check`` (what its CI runs) passes as generated: its drift record is
    empty, which check reports and does not fail on, until ``check --record`` writes it."""
    created = run(HFPATCH, "new", "norms", "--structural", "--no-input", "-o", str(tmp_path / "projects"))
    assert created.returncode == 0, created.stdout + created.stderr
    project = tmp_path / "projects" / "hfpatch-pack-norms"
    texts = {path: path.read_text() for path in project.rglob("*") if path.is_file()}
    assert [path.name for path, text in texts.items() if "LlamaMLP" in text or "Patched" in text] == []
    assert 'description = "hfpatch pack replacing every RMS norm' in texts[project / "pyproject.toml"]
    assert "functional_class" in texts[project / "README.md"] and "generated empty" in texts[project / "README.md"]
    record = project / "hfpatch_pack_norms" / "hfpatch-record.json"
    assert json.loads(record.read_text()) == {"format": 1, "pack": "norms", "releases": {}}
    assert "hfpatch check norms" in texts[project / ".github" / "workflows" / "tests.yml"]
    site = tmp_path / "site"
    install = run(
        sys.executable,
        *("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--disable-pip-version-check", "-q"),
        *("--target", str(site), str(project)),
    )
    assert install.returncode == 0, install.stdout + install.stderr
    cache = {"HF_PATCH_CACHE": str(tmp_path / "cache")}
    checked = run(HFPATCH, "check", "norms", site=site, env=cache, timeout=900)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert lines[0].startswith("ok    norms 0.1.0: targets ") and "llama" in lines[0].split(", ")
    assert lines[-1] == "      no drift record: `hfpatch check --record norms` writes one (not a failure)"
    # refusals are shown, with the model types where the pack only refuses (cohere: a layer norm)
    assert any(line.startswith("      refused (left as it is): cohere: CohereLayerNorm: ") for line in lines)
    recorded = run(HFPATCH, "check", "--record", "norms", site=site, env=cache)  # from the cache
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    written = json.loads((site / "hfpatch_pack_norms" / "hfpatch-record.json").read_text())
    version = importlib.metadata.version("transformers")
    assert list(written["releases"]) == [version]
    assert {"model_type": "llama", "class": "LlamaRMSNorm"} in [
        {"model_type": entry["model_type"], "class": entry["class"]} for entry in written["releases"][version]
    ]
    again = run(HFPATCH, "check", "norms", site=site, env=cache)
    assert again.returncode == 0 and "drift" not in again.stdout and "no drift record" not in again.stdout
