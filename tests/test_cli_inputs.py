"""The ``hfpatch`` command's speed-ups, checked by what they do, not by time (issue 40 point 4):
bad input is reported before transformers is imported, a second ``list`` / ``lock --check``
reads the cache (``HF_PATCH_CACHE``) and imports neither torch nor transformers, a corrupt or
stale cache is ignored and rewritten, long steps say so on stderr; and ``--version``,
``HF_PATCH_LOCK`` naming no file (issue 40 point 7) and ``make help``.

Every command runs in a subprocess of its own, so that ``sys.modules`` says what it imported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hfpatch_core
from packs import MLP_PACK, PackSpec, mlp_pack, write_pack

pytestmark = pytest.mark.release_independent

ROOT = Path(hfpatch_core.__file__).resolve().parents[1]
CHECKOUT = str(ROOT) if (ROOT / "pyproject.toml").is_file() else ""

#: Runs the command in-process and reports, on its last stderr line, whether torch or transformers were imported.
DRIVER = """
import sys
from hfpatch_core.cli.console import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("imported:", ",".join(name for name in ("torch", "transformers") if name in sys.modules) or "-", file=sys.stderr)
sys.exit(code)
"""


class Result:
    def __init__(self, completed: subprocess.CompletedProcess[str]) -> None:
        self.code = completed.returncode
        self.stdout = completed.stdout
        lines = completed.stderr.splitlines()
        assert lines and lines[-1].startswith("imported: "), completed.stderr
        self.imported = set(lines[-1].removeprefix("imported: ").split(",")) - {"-"}
        self.stderr = "\n".join(lines[:-1])

    @property
    def progress(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("hfpatch: ") and "error" not in line]


def hfpatch(*args: str, site: Path | None, cache: Path, cwd: Path | None = None, **env: str) -> Result:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_PATCH", "HFPATCH"))}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(site) if site else "", CHECKOUT) if p)
    environment["HF_PATCH_CACHE"] = str(cache)
    environment.update(env)
    completed = subprocess.run(
        [sys.executable, "-c", DRIVER, *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=cwd,
        timeout=300,
        check=False,
    )
    return Result(completed)


@pytest.fixture
def two_packs(install) -> Path:
    """Two packs that both target llama, so that ``list`` plans it to look for conflicts."""
    return install(PackSpec("mlp", MLP_PACK), PackSpec("rival", mlp_pack("RivalMLP", priority=5)))


def test_a_second_list_reads_the_cache_and_imports_neither_torch_nor_transformers(two_packs, tmp_path) -> None:
    cache = tmp_path / "cache"
    first = hfpatch("list", "--json", site=two_packs, cache=cache)
    assert first.code == 0, first.stderr
    assert "transformers" in first.imported  # finding conflicts plans llama with both packs
    assert any("finding the conflicts" in line for line in first.progress), first.stderr
    second = hfpatch("list", "--json", site=two_packs, cache=cache)
    assert second.code == 0, second.stderr
    assert second.imported == set(), second.stderr
    assert second.progress == []
    assert json.loads(second.stdout) == json.loads(first.stdout)
    assert json.loads(first.stdout)["conflicts_checked_on"] == ["llama"]


def test_a_corrupt_cache_is_ignored_and_rewritten(two_packs, tmp_path) -> None:
    cache = tmp_path / "cache"
    assert hfpatch("list", site=two_packs, cache=cache).code == 0
    (file,) = cache.glob("conflicts-*.json")
    file.write_text("{not json")
    again = hfpatch("list", site=two_packs, cache=cache)
    assert again.code == 0, again.stderr
    assert "transformers" in again.imported
    assert json.loads(file.read_text())["entries"]  # written again, whole
    assert hfpatch("list", site=two_packs, cache=cache).imported == set()


def test_a_cache_written_for_other_installed_versions_is_stale(two_packs, tmp_path) -> None:
    cache = tmp_path / "cache"
    assert hfpatch("list", site=two_packs, cache=cache).code == 0
    # the rival pack upgraded: its conflicts may have changed, so they are found again
    shutil.rmtree(next(two_packs.glob("hfpatch_pack_rival-*.dist-info")))
    write_pack(two_packs, PackSpec("rival", mlp_pack("RivalMLP", priority=5), version="2.0.0"))
    upgraded = hfpatch("list", "--json", site=two_packs, cache=cache)
    assert upgraded.code == 0, upgraded.stderr
    assert "transformers" in upgraded.imported
    assert any("finding the conflicts" in line for line in upgraded.progress)
    (file,) = cache.glob("conflicts-*.json")
    assert ["rival", "hfpatch-pack-rival", "2.0.0"] in [
        pack[:3] for pack in json.loads(file.read_text())["key"]["packs"]
    ]


def test_a_second_lock_check_reads_the_cache(install, tmp_path) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    cache, lock = tmp_path / "cache", tmp_path / "hfpatch.lock"
    written = hfpatch("lock", "-o", str(lock), site=site, cache=cache, HF_PATCH_PACKS="mlp")
    assert written.code == 0, written.stderr
    assert any("planning the model types" in line for line in written.progress), written.stderr
    checked = hfpatch("lock", "--check", str(lock), site=site, cache=cache)  # unset: the lock's selection
    assert checked.code == 0, checked.stdout + checked.stderr
    assert "matches" in checked.stdout
    assert checked.imported == set(), checked.stderr
    # --no-cache plans again
    fresh = hfpatch("--no-cache", "lock", "--check", str(lock), site=site, cache=cache)
    assert fresh.code == 0 and "transformers" in fresh.imported
    # an edited pack is another key: planned again, and the lock's pack check reports the edit
    with open(site / "hfpatch_test_pack_mlp.py", "a") as handle:
        handle.write("# edited\n")
    edited = hfpatch("lock", "--check", str(lock), site=site, cache=cache)
    assert edited.code == 1 and "edited since installed" in edited.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["check", "nosuch"], {}, r"hfpatch check 'nosuch' names pack 'nosuch', which is not installed"),
        (["explain", "llama"], {"HF_PATCH_PACKS": "mlpp"}, r"names pack 'mlpp'.*did you mean 'mlp'\?"),
        (["list"], {"HF_PATCH_PACKS": "mlp,,@"}, r"HF_PATCH_PACKS="),
        (["explain", "lama"], {}, r"'lama' is neither a checkpoint directory nor a model type.*did you mean 'llama'"),
        (["explain", "./nowhere"], {}, r"explain './nowhere': the path does not exist"),
        (["check", "--model-type", "lama"], {}, r"--model-type 'lama' is not a model type"),
        (["verify", "--model", "/nonexistent/ckpt"], {}, r"--model '/nonexistent/ckpt': the path does not exist"),
        (["lock", "--model", "/nonexistent/ckpt"], {}, r"--model '/nonexistent/ckpt': the path does not exist"),
        (["lock", "--model-type", "lama"], {}, r"--model-type 'lama' is not a model type"),
        (["demo", "--model", "/nonexistent/ckpt"], {}, r"--model '/nonexistent/ckpt': the path does not exist"),
        (["explain", "llama", "--bogus"], {}, r"unrecognized arguments: --bogus"),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, list) else None,
)
def test_bad_input_is_reported_before_transformers_is_imported(install, tmp_path, args, env, message) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    cache = tmp_path / "cache"
    # the model type names come from the cache, written once per installed transformers
    warm = subprocess.run(
        [sys.executable, "-c", "from hfpatch_core.cli.cache import model_types; model_types()"],
        env={**os.environ, "HF_PATCH_CACHE": str(cache), "PYTHONPATH": CHECKOUT},
        check=True,
        timeout=120,
    )
    assert warm.returncode == 0
    result = hfpatch(*args, site=site, cache=cache, **env)
    assert result.code == 2, result.stdout + result.stderr
    assert re.search(message, result.stderr, re.S), result.stderr
    assert result.imported == set(), result.stderr


def test_explain_of_a_folder_named_without_a_path_says_what_it_lacks(tmp_path) -> None:
    """Issue 44.7: ``hfpatch explain EMPTYDIR`` printed transformers' "Unrecognized model in EMPTYDIR"."""
    (tmp_path / "EMPTYDIR").mkdir()
    result = hfpatch("explain", "EMPTYDIR", site=None, cache=tmp_path / "cache", cwd=tmp_path)
    assert result.code == 2, result.stdout + result.stderr
    assert "explain 'EMPTYDIR': no config.json in it; give a checkpoint directory saved by save_pretrained" in (
        result.stderr
    )


def test_explain_reads_a_model_type_as_a_model_type_even_beside_a_folder_of_its_name(tmp_path, capsys) -> None:
    from transformers import Qwen2Config

    from hfpatch_core.cli import main

    Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
        tmp_path / "llama"
    )
    os.chdir(tmp_path)
    try:
        assert main(["explain", "llama", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["model_class"] == "LlamaForCausalLM"
        assert main(["explain", "./llama", "--json"]) == 0  # written as a path: the folder
        assert json.loads(capsys.readouterr().out)["model_class"] == "Qwen2ForCausalLM"
    finally:
        os.chdir(ROOT)


@pytest.mark.parametrize(
    "args",
    [["list"], ["explain", "llama"], ["check"], ["verify"], ["lock", "--check", "other.lock"], ["lock"], ["demo"]],
    ids=lambda args: " ".join(args),
)
def test_a_lock_variable_naming_no_file_is_the_same_error_for_every_command(tmp_path, args) -> None:
    missing = str(tmp_path / "nonexistent.lock")
    result = hfpatch(*args, site=None, cache=tmp_path / "cache", cwd=tmp_path, HF_PATCH_LOCK=missing)
    assert result.code == 2, result.stdout + result.stderr
    assert result.stderr == (
        f"hfpatch: error: HF_PATCH_LOCK={missing!r} names no file; write it with `hfpatch lock -o {missing}`, "
        "or unset it"
    )
    assert result.imported == set()


def test_lock_may_write_the_lock_the_variable_names(install, tmp_path) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    lock = tmp_path / "hfpatch.lock"
    result = hfpatch("lock", "-o", str(lock), site=site, cache=tmp_path / "cache", HF_PATCH_LOCK=str(lock))
    assert result.code == 0, result.stderr
    assert json.loads(lock.read_text())["selection"] == "all"


def test_version_names_hfpatch_core_transformers_and_every_pack(install, tmp_path) -> None:
    import importlib_metadata

    site = install(PackSpec("mlp", MLP_PACK, version="1.2.0"))
    result = hfpatch("--version", site=site, cache=tmp_path / "cache")
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"hfpatch-core {importlib_metadata.version('hfpatch-core')}"
    assert lines[1] == f"transformers {importlib_metadata.version('transformers')}"
    assert lines[2] == "packs: mlp 1.2.0 (hfpatch-pack-mlp)"
    assert result.imported == set()


def test_make_help_lists_every_target_with_one_line() -> None:
    makefile = (ROOT / "Makefile").read_text()
    (phony,) = re.findall(r"^\.PHONY: (.*)$", makefile, re.M)
    result = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    shown = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for target in phony.split():
        assert target in shown, f"make help does not list {target}"
        assert len(shown[target].split(None, 1)) == 2, f"make help gives {target} no description"
