"""pytest fixtures for pack authors (registered through the ``pytest11`` entry point).

Kept free of heavy imports: torch and transformers load only when a fixture is used.
``hfpatch_isolation`` records and restores global state with ``hfpatch_core._runtime.snapshot``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from . import settings
from ._runtime.snapshot import GlobalState


@pytest.fixture
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint_factory("llama", num_hidden_layers=1)``: a small random checkpoint directory.

    ``hfpatch_core.testing.tiny_checkpoint`` writing into pytest's temporary directories;
    takes a model type or a config, ``seed=`` and config overrides, and returns the directory.
    """
    from .testing import tiny_checkpoint as build

    def factory(model_type_or_config: Any, *, seed: int = 0, **overrides: Any) -> Path:
        name = model_type_or_config if isinstance(model_type_or_config, str) else "config"
        return build(model_type_or_config, tmp_path_factory.mktemp(f"tiny-{name}"), seed=seed, **overrides)

    return factory


@pytest.fixture
def tiny_checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Callable[..., Path]:
    """The old name of ``tiny_checkpoint_factory``, kept for packs generated before it was renamed.

    It shadows the function ``hfpatch_core.testing.tiny_checkpoint`` inside a test that
    imports both; new tests request ``tiny_checkpoint_factory``.
    """
    return tiny_checkpoint_factory


#: What ``tiny_checkpoints`` gives: the cases (name -> a config, or a function making one) -> their directories.
TinyCheckpoints = Callable[[Mapping[str, Any]], dict[str, Path]]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyCheckpoints]:
    """``tiny_checkpoints({"llama": llama_config, ...})``: a suite's cases saved, once per session.

    What a pack suite's session-scoped ``checkpoints`` fixture returns::

        CASES = {"llama": lambda: LlamaConfig(**TINY_DECODER), ...}

        @pytest.fixture(scope="session")
        def checkpoints(tiny_checkpoints: TinyCheckpoints) -> dict[str, Path]:
            return tiny_checkpoints(CASES)

    Each case, a config or a function making one, is saved with
    ``hfpatch_core.testing.tiny_checkpoint`` by vanilla transformers (whatever packs the
    environment or an ``enable()`` chose), the n-th with seed n, each into a directory of
    its own under pytest's temporary directory.  Returns the directories by case name, in
    the mapping's order.

    From its first use to the end of the session, transformers' progress bars are off and
    its logs below errors are not shown (every load of a pack suite would print them); both
    are put back afterwards.
    """
    from transformers.utils import logging

    from .testing import tiny_checkpoint

    def save(cases: Mapping[str, Any]) -> dict[str, Path]:
        paths = {}
        for seed, (name, case) in enumerate(cases.items()):
            config = case() if callable(case) else case
            paths[name] = tiny_checkpoint(config, tmp_path_factory.mktemp(name), seed=seed)
        return paths

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield save
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


@pytest.fixture
def hfpatch_disabled() -> Iterator[None]:
    """Make sure hfpatch is disabled around the test."""
    from ._session.loaders import disable

    disable()
    yield
    disable()


class HfPatchIsolation:
    """The handle ``hfpatch_isolation`` gives the test.

    Attributes:
        changes_allowed: whether ``allow_changes()`` was called; the state is then
            restored after the test without a report.
    """

    def __init__(self) -> None:
        self.changes_allowed = False

    def allow_changes(self) -> None:
        """Let this test leave global state changed on purpose: it is still restored, but not reported."""
        self.changes_allowed = True


@dataclasses.dataclass
class _Isolation:
    """What ``hfpatch_isolation`` recorded before the test's fixtures were set up."""

    state: GlobalState
    handle: HfPatchIsolation
    session: Any


_ISOLATION = pytest.StashKey[_Isolation]()


def _isolate(item: pytest.Item) -> _Isolation:
    from ._session.loaders import settle_autorun
    from ._session.session import active_session

    settle_autorun(enable=True)  # HF_PATCH_PACKS=x pytest: the session start-up chose is the one restored
    isolation = _Isolation(GlobalState.capture(), HfPatchIsolation(), active_session())
    item.stash[_ISOLATION] = isolation
    return isolation


def pytest_configure(config: pytest.Config) -> None:
    # the line a process prints at its first patched load would land in whichever test loads
    # first, where a test reading stderr gets it: pytest's header names the plugins instead
    from ._session.announcement import silence

    silence()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # Recorded before any fixture is set up, and compared after every fixture is torn
    # down (below): what a fixture changes with monkeypatch, in whatever order the test
    # requests them, is undone by then and neither reported nor "restored" into place.
    if "hfpatch_isolation" in getattr(item, "fixturenames", ()):
        _isolate(item)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        result = yield
    finally:
        isolation = item.stash.get(_ISOLATION, None)
        leaks = _finish(isolation) if isolation is not None else []
    if leaks:
        pytest.fail(
            "hfpatch_isolation: the test left global state changed (restored now; left as it was, it "
            "would change every later load in this process):\n"
            + "\n".join(f"- {leak}" for leak in leaks)
            + "\nIf the test changes it on purpose, call hfpatch_isolation.allow_changes().",
            pytrace=False,
        )
    return result


def _finish(isolation: _Isolation) -> list[str]:
    """Restore what was recorded; the changes to report."""
    from ._session import loaders

    loaders.disable()
    leaks = isolation.state.restore()
    if isolation.session is not None:
        loaders.install(isolation.session)  # enabled before the test (hfpatch run -- pytest)
    return [] if isolation.handle.changes_allowed else leaks


@pytest.fixture
def hfpatch_isolation(request: pytest.FixtureRequest) -> Iterator[HfPatchIsolation]:
    """Run the test from a clean global state, and fail it if it leaves that state changed.

    Before the test: hfpatch is disabled and every hfpatch environment variable
    (``HF_PATCH_PACKS``, ``HF_PATCH_STRICT``, ``HFPATCH_AUTORUN``) is unset.  The global
    state a patched load changes and must put back is recorded before any of the
    test's fixtures is set up: transformers' patch registry
    (``transformers.monkey_patching``), its checkpoint conversion registry
    (``transformers.conversion_mapping``), the classes bound in every loaded
    ``transformers*`` module, and the class-level ``_can_record_outputs`` tables of
    those classes (with the ``target_class`` of each ``OutputRecorder`` in them).

    After every fixture of the test is torn down (so what a test or fixture patched with
    ``monkeypatch`` is undone and not counted): the environment is as before, everything
    recorded is restored, and hfpatch is disabled, or enabled again with the session it
    had before the test.  Choosing packs and enabling hfpatch is what tests do, so
    neither is reported; if anything recorded had changed, the test errors at teardown
    with a message naming each change.  A recorder table of a class first imported
    during the test cannot be restored, but one that points at a class defined outside
    transformers is reported.  A test that changes this state on purpose calls
    ``hfpatch_isolation.allow_changes()``: the state is then restored without a report.

    Yields:
        The handle with ``allow_changes()``.
    """
    from ._session.loaders import disable

    isolation = request.node.stash.get(_ISOLATION, None)
    if isolation is None:  # requested with getfixturevalue: record from here
        isolation = _isolate(request.node)
    environment = {name: os.environ.get(name) for name in _environment_names()}
    for name in environment:
        os.environ.pop(name, None)
    disable()
    try:
        yield isolation.handle
    finally:
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _environment_names() -> list[str]:
    """Every environment variable ``hfpatch_core.settings`` names (its ``*_ENV`` constants)."""
    return [value for name, value in vars(settings).items() if name.endswith("_ENV") and isinstance(value, str)]
