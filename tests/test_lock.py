"""``hfpatch lock``, ``HF_PATCH_LOCK`` / ``enable(lock=...)``, ``HF_PATCH_AUTOLOAD`` and ``hfpatch list``'s
required-by column, on packs installed as real distributions."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import transformers
from transformers import LlamaForCausalLM

import hfpatch_core
from conftest import tiny_llama_config
from hfpatch_core._pipeline.locking import LockedPlan
from hfpatch_core.cli import main
from hfpatch_core.plan import plan_of
from hfpatch_core.testing import install_pack
from packs import MLP_PACK, PackSpec, mlp_pack, write_pack

#: A pack whose plan follows a variable, not its files: the plan changes with nothing reinstalled.
SWITCHING_PACK = """
    import os
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaMLP

    class FirstMLP(LlamaMLP):
        pass

    class SecondMLP(LlamaMLP):
        pass

    @hookimpl
    def provide_patches(context):
        if context.model_type != "llama":
            return []
        return [Patch("LlamaMLP", SecondMLP if os.environ.get("SWITCHING_PACK_SECOND") else FirstMLP)]
"""


def load() -> LlamaForCausalLM:
    return LlamaForCausalLM._from_config(tiny_llama_config())


def write_lock(path: Path, *arguments: str) -> dict:
    assert main(["lock", "-o", str(path), *arguments]) == 0
    return json.loads(path.read_text())


@pytest.fixture
def locked(install, monkeypatch, tmp_path) -> tuple[Path, Path]:
    """Pack ``mlp`` installed and selected, and its lock: (site, lock file)."""
    site = install(PackSpec("mlp", MLP_PACK))
    monkeypatch.setenv("HF_PATCH_PACKS", "mlp")
    lock = tmp_path / "hfpatch.lock"
    write_lock(lock)
    return site, lock


def test_the_lock_holds_the_packs_and_plans_and_a_load_that_matches_passes(locked, capsys) -> None:
    _, lock = locked
    data = json.loads(lock.read_text())
    assert data["selection"] == "mlp"
    pack = data["packs"]["mlp"]
    assert (pack["distribution"], pack["version"], len(pack["sha256"])) == ("hfpatch-pack-mlp", "1.0.0", 64)
    plan = data["plans"]["llama"]
    assert plan["replaced"] == {"LlamaMLP": "hfpatch_test_pack_mlp.PackMLP [mlp==1.0.0]"}
    with hfpatch_core.enabled(lock=lock):
        model = load()
    assert type(model.model.layers[0].mlp).__name__ == "PackMLP"
    assert LockedPlan.of(plan_of(model)).decision == plan["decision"]
    assert plan["from"] == "default config"
    capsys.readouterr()
    assert main(["lock", "--check", str(lock)]) == 0
    assert "matches" in capsys.readouterr().out


def _added(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_pack(site.with_name(site.name + "-more"), PackSpec("extra", mlp_pack("ExtraMLP", priority=1)))
    monkeypatch.setenv("HF_PATCH_PACKS", "all")


def _removed(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.rmtree(next(site.glob("hfpatch_pack_mlp-*.dist-info")))


def _upgraded(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.rmtree(next(site.glob("hfpatch_pack_mlp-*.dist-info")))
    write_pack(site, PackSpec("mlp", MLP_PACK, version="1.1.0"))


def _edited(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(site / "hfpatch_test_pack_mlp.py", "a") as handle:
        handle.write("# edited in place\n")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_added, "pack 'extra' (hfpatch-pack-extra 1.0.0) was added"),
        (_removed, "pack 'mlp' (hfpatch-pack-mlp 1.0.0) is locked but not installed"),
        (_upgraded, "pack 'mlp' (hfpatch-pack-mlp) is version 1.1.0 (locked: 1.0.0)"),
        (_edited, "edited since installed: hfpatch_test_pack_mlp.py"),
    ],
    ids=["added", "removed", "upgraded", "edited"],
)
def test_a_changed_pack_fails_the_load_before_it_builds(locked, monkeypatch, change, expected) -> None:
    site, lock = locked
    if change is _removed:
        monkeypatch.setenv("HF_PATCH_PACKS", "none")
    change(site, monkeypatch)
    with hfpatch_core.enabled(lock=lock), pytest.raises(hfpatch_core.LockError) as caught:
        load()
    assert expected in str(caught.value)
    assert f"hfpatch lock -o {lock}" in str(caught.value)
    assert isinstance(caught.value, hfpatch_core.ConfigurationError)
    # the same difference without a model: hfpatch lock --check
    assert main(["lock", "--check", str(lock)]) == 1


def test_an_edit_made_after_the_first_locked_load_is_seen(locked) -> None:
    site, lock = locked
    with hfpatch_core.enabled(lock=lock):
        load()  # hashed here, once
        _edited(site, pytest.MonkeyPatch())
        with pytest.raises(hfpatch_core.LockError, match="edited since installed"):
            load()


def test_a_different_plan_with_the_same_packs_fails_the_load(install, monkeypatch, tmp_path) -> None:
    install(PackSpec("switching", SWITCHING_PACK))
    monkeypatch.setenv("HF_PATCH_PACKS", "switching")
    lock = tmp_path / "hfpatch.lock"
    write_lock(lock)
    monkeypatch.setenv("SWITCHING_PACK_SECOND", "1")
    monkeypatch.setenv("HF_PATCH_LOCK", str(lock))
    hfpatch_core.enable()
    with pytest.raises(hfpatch_core.LockError) as caught:
        load()
    assert (
        "model type 'llama': LlamaMLP is replaced by hfpatch_test_pack_switching.SecondMLP [switching==1.0.0] "
        "(locked: hfpatch_test_pack_switching.FirstMLP [switching==1.0.0])"
    ) in str(caught.value)
    # the plan follows a variable, not the installed files that key the cache: --no-cache plans again
    assert main(["--no-cache", "lock", "--check", str(lock)]) == 1


def test_a_model_type_the_lock_has_no_plan_for_passes_under_the_locked_transformers_only(
    install, monkeypatch, tmp_path
) -> None:
    """Issue 44.6: the locked packs, unchanged, decide now what they decided when the lock was written,
    for every model type, planned then or not; under another transformers they may not."""
    install(PackSpec("mlp", MLP_PACK))
    monkeypatch.setenv("HF_PATCH_PACKS", "mlp")
    lock = tmp_path / "hfpatch.lock"
    data = write_lock(lock)
    del data["plans"]["llama"]
    lock.write_text(json.dumps(data))
    with hfpatch_core.enabled(lock=lock):
        model = load()
    assert type(model.model.layers[0].mlp).__name__ == "PackMLP"
    data["transformers"] = "5.0.0.dev0"
    lock.write_text(json.dumps(data))
    with hfpatch_core.enabled(lock=lock), pytest.raises(hfpatch_core.LockError) as caught:
        load()
    assert "model type 'llama' has no plan in the lock" in str(caught.value)
    assert f"transformers is {transformers.__version__} (locked: 5.0.0.dev0)" in str(caught.value)
    assert "--model-type llama" in str(caught.value)


def test_lock_check_exit_codes_and_a_missing_lock(locked, install, monkeypatch, capsys, tmp_path) -> None:
    site, lock = locked
    assert main(["lock", "--check", str(lock)]) == 0
    _added(site, monkeypatch)
    capsys.readouterr()
    assert main(["lock", "--check", str(lock)]) == 1
    out = capsys.readouterr().out
    assert "differs" in out and "  - pack 'extra'" in out
    assert main(["lock", "--check", str(tmp_path / "absent.lock")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(hfpatch_core.LockError, match="cannot be read"):
        hfpatch_core.enable(lock=tmp_path / "absent.lock")


def test_under_a_lock_an_unset_selection_means_the_locked_selection(locked, monkeypatch, capsys) -> None:
    site, lock = locked
    monkeypatch.delenv("HF_PATCH_PACKS")
    monkeypatch.setenv("HF_PATCH_AUTOLOAD", "0")  # the lock is the explicit choice: it wins over autoload off
    with hfpatch_core.enabled(lock=lock) as selection:
        assert list(selection.packs) == ["mlp"]
        assert selection.spec.quoted == "the selection of the lock (HF_PATCH_LOCK) 'mlp'"
        assert type(load().model.layers[0].mlp).__name__ == "PackMLP"
    assert main(["lock", "--check", str(lock)]) == 0
    monkeypatch.setenv("HF_PATCH_LOCK", str(lock))
    capsys.readouterr()
    assert main(["list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["packs"][0]["status"] == "enabled"
    # a pack installed after the lock was written is not in its selection ('mlp'): nothing changes
    write_pack(site.with_name(site.name + "-more"), PackSpec("extra", mlp_pack("ExtraMLP", priority=1)))
    with hfpatch_core.enabled(lock=lock) as selection:
        assert list(selection.packs) == ["mlp"]
        assert type(load().model.layers[0].mlp).__name__ == "PackMLP"


def test_autoload_off_makes_an_unset_selection_mean_no_pack(install, monkeypatch) -> None:
    install(PackSpec("mlp", MLP_PACK))
    with hfpatch_core.enabled() as selection:
        assert "mlp" in selection.packs  # the documented default: every installed pack
    monkeypatch.setenv("HF_PATCH_AUTOLOAD", "0")
    with hfpatch_core.enabled() as selection:
        assert not selection.packs
        assert selection.status["mlp"] == "disabled: HF_PATCH_PACKS unset and HF_PATCH_AUTOLOAD=0"
        assert type(load().model.layers[0].mlp).__name__ == "LlamaMLP"
    monkeypatch.setenv("HF_PATCH_PACKS", "mlp")
    with hfpatch_core.enabled() as selection:
        assert list(selection.packs) == ["mlp"]
    monkeypatch.setenv("HF_PATCH_AUTOLOAD", "maybe")
    with pytest.raises(ValueError, match="HF_PATCH_AUTOLOAD='maybe' is not a boolean"):
        hfpatch_core.enable()


def test_list_shows_which_distribution_required_each_pack(install, capsys, tmp_path) -> None:
    site = install(PackSpec("mlp", MLP_PACK), PackSpec("other", mlp_pack("OtherMLP")))
    for name, requires in [
        ("my-app", ["hfpatch-pack-mlp>=1"]),
        ("trainer-kit", ["Hfpatch_Pack_MLP; extra == 'fast'", "hfpatch-pack-other; python_version < '3'"]),
    ]:
        dist_info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        dist_info.mkdir()
        lines = [f"Name: {name}", "Version: 1.0", "Provides-Extra: fast", *(f"Requires-Dist: {r}" for r in requires)]
        (dist_info / "METADATA").write_text("Metadata-Version: 2.1\n" + "\n".join(lines) + "\n")
    assert main(["list", "--json", "--no-conflicts"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["packs"]}
    assert rows["mlp"]["required_by"] == ["my-app", "trainer-kit[fast]"]
    assert rows["other"]["required_by"] == []
    assert main(["list", "--no-conflicts"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "required by" in table[0]
    assert any(line.startswith("mlp ") and "my-app, trainer-kit[fast]" in line for line in table)
    assert any(line.startswith("other ") and " - " in line for line in table)


def test_install_pack_records_its_files_as_pip_does(tmp_path) -> None:
    dist_info = install_pack(tmp_path / "site", "recorded", MLP_PACK)
    record = (dist_info / "RECORD").read_text().splitlines()
    assert record[0].startswith("hfpatch_test_pack_recorded.py,sha256=")
    assert record[-1] == f"{dist_info.name}/RECORD,,"
    sys.modules.pop("hfpatch_test_pack_recorded", None)


RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
import hfpatch_core
from transformers import AutoModelForCausalLM

checkpoint, lock, out = sys.argv[1:4]
rank = int(os.environ["RANK"])
try:
    hfpatch_core.enable(lock=lock)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, tp_plan="auto")
    result = {"error": None, "mlp": type(model.model.layers[0].mlp).__name__}
except Exception as exc:
    result = {"error": f"{type(exc).__name__}: {exc}"}
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump(result, handle)
if dist.is_initialized():
    dist.destroy_process_group()
"""


@pytest.mark.release_independent
def test_every_torchrun_rank_checks_the_lock_alike(locked, tmp_path) -> None:
    """Under ``torchrun --nproc_per_node 2`` (gloo) with ``tp_plan="auto"``: both ranks load under the
    lock, then, with a pack file edited, both raise the same LockError before building."""
    import os
    import subprocess

    from hfpatch_core.testing import tiny_checkpoint

    site, lock = locked
    checkpoint = tiny_checkpoint("llama", tmp_path / "llama")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
        "HF_PATCH_PACKS": "mlp",
        "USE_HUB_KERNELS": "0",
        "OMP_NUM_THREADS": "1",
    }

    def ranks(name: str) -> list[dict]:
        out = tmp_path / name
        out.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        done = subprocess.run(
            [*command, str(script), str(checkpoint), str(lock), str(out)],
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]

    assert ranks("matching") == [{"error": None, "mlp": "PackMLP"}] * 2
    _edited(site, pytest.MonkeyPatch())
    edited = ranks("edited")
    assert edited[0] == edited[1] and edited[0]["error"].startswith("LockError: ")
    assert "edited since installed: hfpatch_test_pack_mlp.py" in edited[0]["error"]


@pytest.fixture(scope="session")
def fused_dense_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first-party fused-dense pack, built as a wheel and installed (once) on a path entry of its own:
    its converters carry the sizes of the config they are made for (``SizedConcatenate(sizes=[...])``)."""
    from hfpatch_core.testing import install_wheel

    site = tmp_path_factory.mktemp("fused-dense") / "site"
    install_wheel(Path(hfpatch_core.__file__).resolve().parents[1] / "plugins" / "hfpatch-pack-fused-dense", site)
    return site


def _checkpoint(directory: Path, **sizes: int) -> Path:
    with hfpatch_core.enabled(packs="none"):
        LlamaForCausalLM(tiny_llama_config(**sizes)).save_pretrained(directory)
    return directory


#: A second llama size: every dimension of the fused projections differs from tiny_llama_config's.
LARGER = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 8, "num_key_value_heads": 4}


def test_one_lock_holds_loads_of_two_sizes_of_a_model_type(fused_dense_site, monkeypatch, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.syspath_prepend(str(fused_dense_site))
    monkeypatch.setenv("HF_PATCH_PACKS", "fused-dense")
    small, large = _checkpoint(tmp_path / "small"), _checkpoint(tmp_path / "large", **LARGER)
    lock = tmp_path / "hfpatch.lock"
    data = write_lock(lock)  # once, from llama's default config (4096 wide)
    converters = data["plans"]["llama"]["converters"]["llama"]
    assert any("[SizedConcatenate]" in line for line in converters), converters
    assert not any("sizes" in line or "4096" in line for line in converters), converters
    plans = []
    for checkpoint in (small, large):
        with hfpatch_core.enabled(lock=lock):
            model = AutoModelForCausalLM.from_pretrained(checkpoint)
        assert type(model.model.layers[0].self_attn).__name__.startswith("FusedQKV")
        plan = plan_of(model)
        assert LockedPlan.of(plan).decision == data["plans"]["llama"]["decision"]
        plans.append(plan)
    # the two loads converted with different sizes (and their plans' fingerprints differ) under one lock
    assert plans[0].fingerprint != plans[1].fingerprint
    # --model DIR of both sizes: one plan for llama, as the packs decide alike for both
    both = write_lock(tmp_path / "both.lock", "--model", str(small), "--model", str(large))
    assert both["plans"]["llama"]["decision"] == data["plans"]["llama"]["decision"]
    assert both["plans"]["llama"]["from"] == str(small)


def test_the_lock_is_the_same_file_from_any_working_directory(install, monkeypatch, tmp_path) -> None:
    install(PackSpec("mlp", MLP_PACK))
    monkeypatch.setenv("HF_PATCH_PACKS", "mlp")
    plain, crowded = tmp_path / "plain", tmp_path / "crowded"
    plain.mkdir()
    # a folder named like the model type, holding another model type's checkpoint config
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
        crowded / "llama"
    )
    written = []
    for where in (plain, crowded):
        monkeypatch.chdir(where)
        assert main(["lock", "-o", str(tmp_path / f"{where.name}.lock")]) == 0
        written.append((tmp_path / f"{where.name}.lock").read_bytes())
    assert written[0] == written[1]
    assert json.loads(written[1])["plans"]["llama"]["model_class"] == "LlamaForCausalLM"
    # and lock --check from the crowded directory plans llama from its default config too
    assert main(["lock", "--check", str(tmp_path / "plain.lock")]) == 0


def test_a_lock_of_the_previous_format_is_refused_with_how_to_write_it_again(locked) -> None:
    _, lock = locked
    data = json.loads(lock.read_text())
    data["hfpatch_lock"] = 1
    lock.write_text(json.dumps(data))
    with pytest.raises(hfpatch_core.LockError, match=r"not an hfpatch lock of format 2 .*hfpatch lock -o"):
        hfpatch_core.enable(lock=lock)


#: Loads a tiny checkpoint (argv[1]) as a job does under HF_PATCH_LOCK; prints the attention class or the error.
_FLEET_LOAD = """
import sys
import hfpatch_core
hfpatch_core.enable()
from transformers import AutoModelForCausalLM
try:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
except hfpatch_core.LockError as exc:
    print("LockError:", exc)
else:
    print(type(model.model.layers[0].self_attn).__name__)
"""


def _installed_first_party(site: Path, *packages: str) -> Path:
    """The first-party packs ``packages`` as ``make venv`` installed them (files and RECORD), copied to ``site``."""
    built = Path(sys.prefix) / "first-party-packs"
    assert (built / "hfpatch_pack_fused_dense").is_dir(), f"no first-party packs in {built}: run make venv"
    for package in packages:
        shutil.copytree(built / package, site / package)
        for dist_info in built.glob(f"{package}-*.dist-info"):
            shutil.copytree(dist_info, site / dist_info.name)
    return site


def test_a_fleet_lock_holds_every_model_type_its_packs_apply_to(tmp_path) -> None:
    """Issue 44.6: ``HF_PATCH_PACKS=qwen-moe,fused-dense hfpatch lock`` plans the types the packs declare
    (no mixtral); a mixtral load under that lock gets fused-dense, and fails once a locked pack changed."""
    import os
    import subprocess

    from hfpatch_core.testing import tiny_checkpoint

    site = _installed_first_party(tmp_path / "site", "hfpatch_pack_qwen_moe", "hfpatch_pack_fused_dense")
    checkout = str(Path(hfpatch_core.__file__).resolve().parents[1])
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_PATCH", "HFPATCH"))}
    environment.update(
        PYTHONPATH=os.pathsep.join([str(site), checkout]),
        HF_PATCH_CACHE=str(tmp_path / "cache"),
        USE_HUB_KERNELS="0",
        OMP_NUM_THREADS="1",
    )
    lock = tmp_path / "hfpatch.lock"
    written = subprocess.run(
        [sys.executable, "-m", "hfpatch_core", "lock", "-o", str(lock)],
        env={**environment, "HF_PATCH_PACKS": "qwen-moe,fused-dense"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert written.returncode == 0, written.stdout + written.stderr
    assert "mixtral" not in json.loads(lock.read_text())["plans"]
    checkpoint = tiny_checkpoint("mixtral", tmp_path / "mixtral")

    def load_under_lock() -> str:
        done = subprocess.run(
            [sys.executable, "-c", _FLEET_LOAD, str(checkpoint)],
            env={**environment, "HF_PATCH_LOCK": str(lock)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    assert load_under_lock() == "FusedQKVMixtralAttention"
    with open(site / "hfpatch_pack_fused_dense" / "__init__.py", "a") as handle:
        handle.write("# edited in place\n")
    changed = load_under_lock()
    assert changed.startswith("LockError:")
    assert "edited since installed: hfpatch_pack_fused_dense/__init__.py" in changed


#: A pack project a pack author works on: ``pip install -e`` of it (hatchling, as ``hfpatch new``'s projects).
EDITABLE_PYPROJECT = """
[build-system]
requires = ["hatchling>=1.21"]
build-backend = "hatchling.build"

[project]
name = "hfpatch-pack-editable"
version = "1.0.0"
dependencies = ["hfpatch-core"]

[project.entry-points."hfpatch.packs"]
editable = "hfpatch_test_pack_editable"

[tool.hatch.build.targets.wheel]
packages = ["hfpatch_test_pack_editable"]
# what hatchling's default editable build writes for a package at the project's root (a .pth naming
# the project's directory), without the `editables` library a --no-build-isolation build would need
dev-mode-dirs = ["."]
"""


def test_an_editable_packs_sources_are_locked(monkeypatch, tmp_path, capsys) -> None:
    """Issue 52.8: ``hfpatch lock --check`` said ``matches`` after an editable pack's ``forward``
    changed (its ``RECORD`` lists the ``.pth`` only); the lock hashes the package's files."""
    import subprocess
    import textwrap

    project, site = tmp_path / "project", tmp_path / "site"
    package = project / "hfpatch_test_pack_editable"
    package.mkdir(parents=True)
    (project / "pyproject.toml").write_text(EDITABLE_PYPROJECT)
    (package / "__init__.py").write_text(textwrap.dedent(MLP_PACK))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--quiet", "--no-deps"]
    subprocess.run([*pip, "--no-build-isolation", "--target", str(site), "-e", str(project)], check=True, timeout=120)
    assert json.loads(next(site.glob("*.dist-info")).joinpath("direct_url.json").read_text())["dir_info"] == {
        "editable": True
    }
    # a --target directory's .pth is not read at start-up: the source directory goes on the path as it would
    sys.path[:0] = [str(site), str(project)]
    monkeypatch.setenv("HF_PATCH_PACKS", "editable")
    lock = tmp_path / "hfpatch.lock"
    write_lock(lock)
    capsys.readouterr()
    assert main(["lock", "--check", str(lock)]) == 0

    source = (package / "__init__.py").read_text()
    edited = source.replace("    pass\n", "    def forward(self, x):\n        return 2 * super().forward(x)\n", 1)
    assert edited != source
    (package / "__init__.py").write_text(edited)
    assert main(["lock", "--check", str(lock)]) == 1
    shown = capsys.readouterr().out
    assert "pack 'editable' (hfpatch-pack-editable 1.0.0) has files that differ from the locked ones" in shown
    assert f"installed in editable mode: its sources in {package} differ from the locked ones" in shown, shown
    with hfpatch_core.enabled(lock=lock), pytest.raises(hfpatch_core.LockError, match="installed in editable mode"):
        load()

    # a file added to the package is a change too; put back as locked, the check passes again
    (package / "__init__.py").write_text(source)
    assert main(["lock", "--check", str(lock)]) == 0
    (package / "kernels.py").write_text("BLOCK = 64\n")
    assert main(["lock", "--check", str(lock)]) == 1
    (package / "kernels.py").unlink()
    (package / "__pycache__").mkdir(exist_ok=True)
    (package / "__pycache__" / "kernels.cpython-311.pyc").write_bytes(b"compiled")  # not the pack's content
    assert main(["lock", "--check", str(lock)]) == 0
