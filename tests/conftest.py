from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import hfpatch_core
import hfpatch_core._session.session
import hfpatch_core.testing  # noqa: F401  (imported here, so pytester's in-process runs never re-import it)
from hfpatch_core._runtime.snapshot import GlobalState, loaded_classes
from hfpatch_core.plan import plan_of
from hfpatch_core.pytest_plugin import HfPatchIsolation
from packs import PackSpec, install_packs

transformers.utils.logging.disable_progress_bar()

pytest_plugins = ["pytester"]

#: The first-party packs, installed as wheels by ``make venv`` on a path entry of their own (the core
#: suite sees only the packs each test installs).
PACKS_SITE = Path(sys.prefix) / "first-party-packs"


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    values: dict[str, object] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    values.update(overrides)
    return LlamaConfig(**values)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny llama checkpoint: random weights, save_pretrained, safetensors."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    assert (path / "model.safetensors").exists()
    return path


def transformers_classes() -> dict[tuple[str, str], object]:
    """Every class-valued attribute of every loaded transformers module."""
    return {key: cls for key, (_, cls) in loaded_classes().items()}


class Snapshot:
    """The global state a patched load changes (``hfpatch_core._runtime.snapshot.GlobalState``) at one moment."""

    def __init__(self) -> None:
        self.state = GlobalState.capture()
        self.classes = {key: cls for key, (_, cls) in self.state.classes.items()}

    def assert_unchanged(self) -> None:
        changes = self.state.changes()
        assert not changes, "global state left changed:\n" + "\n".join(changes)


def race(*workers: Callable[[int], list[str]], iterations: int) -> list[str]:
    """Run each worker ``iterations`` times in its own thread, all starting together; their problems."""
    start = threading.Barrier(len(workers))

    def run(worker: Callable[[int], list[str]]) -> list[str]:
        start.wait(30)
        return [problem for step in range(iterations) for problem in worker(step)]

    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        return [problem for result in pool.map(run, workers) for problem in result]


def vanilla_problems(model, reference: dict[str, torch.Tensor], info, label: str) -> list[str]:
    """What is wrong with ``model`` as a vanilla load of the checkpoint whose state dict is ``reference``."""
    problems = [f"{label}: {kind} {info[kind]}" for kind in ("missing_keys", "unexpected_keys") if info.get(kind)]
    if plan_of(model) is not None:
        problems.append(f"{label}: a vanilla model has a plan")
    attention = type(model.model.layers[0].self_attn).__name__
    if attention != "LlamaAttention":
        problems.append(f"{label}: built with {attention}")
    state = model.state_dict()
    if state.keys() != reference.keys():
        problems.append(f"{label}: keys {sorted(state.keys() ^ reference.keys())[:4]}")
    else:
        problems += [f"{label}: {key} differs" for key in reference if not torch.equal(state[key], reference[key])]
    return problems


@pytest.fixture
def snapshot() -> Snapshot:
    return Snapshot()


@pytest.fixture(autouse=True)
def _isolation(
    hfpatch_isolation: HfPatchIsolation, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HfPatchIsolation]:
    """The shipped ``hfpatch_isolation`` on every test (hfpatch disabled and its variables unset
    before, the global state restored after, a leak fails the test), the test packs'
    modules and ``sys.path`` entries removed afterwards, and the command's cache
    (``HF_PATCH_CACHE``) a directory of the test's own: no test reads what another computed."""
    # beside the test's tmp_path, not in it: a test that lists its tmp_path finds only its own files
    monkeypatch.setenv("HF_PATCH_CACHE", str(tmp_path_factory.mktemp("hfpatch-cache")))
    modules = set(sys.modules)
    path = list(sys.path)
    yield hfpatch_isolation
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if name.startswith("hfpatch_test_pack"):
            del sys.modules[name]
    importlib.invalidate_caches()


Installer = Callable[..., Path]


@pytest.fixture
def install(tmp_path: Path) -> Installer:
    """``install(PackSpec(...), ...)``: write real distributions on a fresh path entry."""
    counter = iter(range(1000))

    def _install(*specs: PackSpec) -> Path:
        return install_packs(tmp_path / f"site{next(counter)}", specs)

    return _install


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # Runs in the controlling process, so the count shows under pytest-xdist too (a test's
    # own print stays in its worker).
    reports = [report for kind in ("passed", "failed") for report in terminalreporter.stats.get(kind, ())]
    if any("test_fault_matrix.py" in getattr(report, "nodeid", "") for report in reports):
        import test_fault_matrix as matrix

        cases, faults, modes = len(matrix.CASES), len(matrix.FAULTS), len(matrix.MODES)
        terminalreporter.write_line(f"fault matrix: {cases} cases ({faults} bad inputs x {modes} modes)")


#: Libraries that patch transformers outside hfpatch (Liger-Kernel, and the Triton it imports), installed
#: by ``make venv`` on a path entry of their own: only the tests that request ``liger`` import them.
FOREIGN_SITE = Path(sys.prefix) / "foreign-libraries"


@pytest.fixture
def liger() -> Iterator[Callable[..., None]]:
    """The real ``liger_kernel.transformers.apply_liger_kernel_to_llama``; what it swaps in transformers
    (modeling_llama's classes and functions, ``LlamaForCausalLM.forward``) is put back after the test."""
    assert (FOREIGN_SITE / "liger_kernel").is_dir(), f"no Liger-Kernel in {FOREIGN_SITE}: run make venv"
    from transformers.models.llama import modeling_llama

    namespace = dict(vars(modeling_llama))
    forward = modeling_llama.LlamaForCausalLM.__dict__["forward"]
    sys.path.insert(0, str(FOREIGN_SITE))  # _isolation restores sys.path; the modules stay imported (7 s)
    importlib.invalidate_caches()
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    try:
        yield apply_liger_kernel_to_llama
    finally:
        for name, value in vars(modeling_llama).copy().items():
            if namespace.get(name, _ABSENT) is not value:
                if name in namespace:
                    setattr(modeling_llama, name, namespace[name])
                else:
                    delattr(modeling_llama, name)
        modeling_llama.LlamaForCausalLM.forward = forward


_ABSENT = object()


@pytest.fixture
def first_party() -> Iterator[None]:
    """The first-party packs installed (``_isolation`` restores sys.path; their modules are dropped after)."""
    assert (PACKS_SITE / "hfpatch_pack_fused_dense").is_dir(), f"no first-party packs in {PACKS_SITE}: run make venv"
    before = set(sys.modules)
    sys.path.insert(0, str(PACKS_SITE))
    importlib.invalidate_caches()
    yield
    for module in set(sys.modules) - before:
        if module.startswith("hfpatch_pack_"):
            del sys.modules[module]
