"""What installing hfpatch, and ``hfpatch run``, add to starting Python.

hfpatch-core installs ``hfpatch_autorun.pth`` into site-packages.  ``site`` runs its one
line in *every* interpreter of that environment, at start-up:

    import os; (os.environ.get("HFPATCH_AUTORUN") or os.environ.get("HF_PATCH_LOCK", "").strip() or
    os.environ.get("HF_PATCH_PACKS", "none").strip() not in ("", "none")) and __import__("_hfpatch_autorun")
    (one line)

With the three variables unset that is three environment lookups; ``hfpatch run`` sets
``HFPATCH_AUTORUN`` (and a user ``HF_PATCH_PACKS``), and the line then imports
``_hfpatch_autorun``, which enables hfpatch at the first load once
``transformers.modeling_utils`` is imported.

How the A/B is made faithful: two throwaway virtual environments are created that
share this venv's interpreter and see its site-packages through symlinks, one entry per
symlink; they differ in exactly one entry, ``hfpatch_autorun.pth`` (present in one,
left out of the other).  Both start through the normal ``site`` machinery (no ``-S``,
no hand-made ``sys.path``), read the same files and the same ``__pycache__``, so the
ratio isolates the ``.pth`` file.  (``python -S`` plus ``PYTHONPATH`` is not equivalent:
it skips every ``.pth`` file, the editable installs' among them, and ``site`` itself.)

Measured, each command in a fresh subprocess, interleaved round by round (medians):

1. ``python -c "import transformers"`` with vs without ``hfpatch_autorun.pth``,
   ``HFPATCH_AUTORUN`` unset: goal <= 1.02.  ``python -c pass`` the same two ways shows
   the ``.pth`` line's absolute cost, where nothing else hides it.
2. ``hfpatch run -- python -c "import transformers"`` vs ``python -c "import transformers"``
   (this venv as installed): goal <= 1.05.  ``hfpatch run`` starts the ``hfpatch`` console
   script, validates ``HF_PATCH_PACKS`` (discovering the installed packs) and ``execve``s
   the command with ``HFPATCH_AUTORUN=1``.
3. For information: ``python -c "import transformers.modeling_utils"`` with
   ``HFPATCH_AUTORUN=1`` vs unset, i.e. what the child pays when it reaches the modeling
   code: the hook puts its stand-ins in front of the loaders (hfpatch itself is enabled
   at the first load, which this does not make).

Run: ``.venv/bin/python bench/startup.py`` (uses the interpreter running it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

from _common import describe_ratio, interleaved, machine_info, median, ratio_verdict, repeat, spread, table, timed

PTH = "hfpatch_autorun.pth"
IMPORT = "import transformers"


def make_view(root: Path, site_packages: Path, *, leave_out: frozenset[str]) -> Path:
    """A virtual environment whose site-packages links every entry of ``site_packages`` but ``leave_out``."""
    prefix = Path(sys.prefix)
    (root / "bin").mkdir(parents=True)
    shutil.copy(prefix / "pyvenv.cfg", root / "pyvenv.cfg")
    (root / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    relative = site_packages.relative_to(prefix)
    view = root / relative
    view.mkdir(parents=True)
    for entry in site_packages.iterdir():
        if entry.name not in leave_out:
            (view / entry.name).symlink_to(entry)
    return root / "bin" / "python"


_DROPPED = ("HFPATCH_AUTORUN", "HF_PATCH_PACKS", "HF_PATCH_STRICT", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")
_PYCACHE: dict[str, str] = {}


def environment(**overrides: str | None) -> dict[str, str]:
    """The children's environment: hfpatch's variables unset, bytecode cached under one prefix."""
    env = {key: value for key, value in os.environ.items() if key not in _DROPPED}
    env.update(_PYCACHE)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def runner(command: list[str], env: dict[str, str]) -> Callable[[], float]:
    def call() -> None:
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)

    call()  # warm-up: fills the bytecode cache and the page cache for this command
    return lambda: timed(call)


def ratio_rows(
    samples: dict[str, list[float]], labels: dict[str, str], pairs: list[tuple[str, str, float | None]]
) -> None:
    rows = [[labels[k], f"{median(v) * 1e3:.1f}", spread(v)] for k, v in samples.items()]
    print(table(["command", "median ms", "IQR ms"], rows))
    for top, bottom, goal in pairs:
        note = f"  goal <= {goal}: {ratio_verdict(samples[top], samples[bottom], goal)}" if goal is not None else ""
        print(f"  {top} / {bottom} = {describe_ratio(samples[top], samples[bottom])}{note}")


def pth_cost(site_packages: Path, count: int) -> float:
    """Seconds ``site`` spends on the installed ``.pth`` file (its variables unset).

    ``site.addpackage`` is exactly what start-up runs for each ``.pth`` file: open it, read
    it, ``exec`` its ``import`` line.
    """
    import site

    variables = ("HFPATCH_AUTORUN", "HF_PATCH_PACKS", "HF_PATCH_LOCK")
    saved = {name: os.environ.pop(name) for name in variables if name in os.environ}
    try:
        samples = repeat(lambda: site.addpackage(str(site_packages), PTH, set()), count)
    finally:
        os.environ.update(saved)
    assert "_hfpatch_autorun" not in sys.modules or saved
    return median(samples)


def check_views(with_pth: Path, without_pth: Path, env: dict[str, str]) -> None:
    probe = (
        "import sys, importlib.util; "
        "print(importlib.util.find_spec('_hfpatch_autorun') is not None, "
        "any('site-packages' in p for p in sys.path), sys.prefix)"
    )
    for python in (with_pth, without_pth):
        output = subprocess.run([str(python), "-c", probe], env=env, check=True, capture_output=True, text=True)
        assert output.stdout.startswith("True True"), output.stdout
    # The .pth line runs in one view only: make HFPATCH_AUTORUN import the hook and look.
    look = "import sys; print('_hfpatch_autorun' in sys.modules)"
    autorun = dict(env, HFPATCH_AUTORUN="1")
    seen = [
        subprocess.run([str(p), "-c", look], env=autorun, check=True, capture_output=True, text=True).stdout.strip()
        for p in (with_pth, without_pth)
    ]
    assert seen == ["True", "False"], seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds of the 'import transformers' runs (default 30)")
    parser.add_argument("--rounds-child", type=int, default=8, help="rounds of section 3 (default 8)")
    parser.add_argument("--rounds-pass", type=int, default=60, help="rounds of the 'python -c pass' runs (default 60)")
    args = parser.parse_args(argv)

    for line in machine_info(torch_and_transformers=False):
        print(line)
    site_packages = Path(sysconfig.get_paths()["purelib"])
    if not (site_packages / PTH).exists():
        print(f"{PTH} is not installed in {site_packages}; install hfpatch-core first")
        return 1
    hfpatch = Path(sys.executable).parent / "hfpatch"
    python = str(Path(sys.prefix) / "bin" / "python")
    print(f"site-packages: {site_packages} ({len(list(site_packages.iterdir()))} entries)")

    with tempfile.TemporaryDirectory(prefix="hfpatch-bench-startup-") as directory:
        root = Path(directory)
        _PYCACHE["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
        print(
            f"children run with PYTHONPYCACHEPREFIX={root / 'pycache'} and bytecode writing on, each command once "
            "before timing: every module (hfpatch_core's too, which an editable checkout under "
            "PYTHONDONTWRITEBYTECODE=1 would recompile at every start) loads from bytecode, as after a pip install"
        )
        versions = subprocess.run(
            [python, "-c", "import transformers, torch; print(transformers.__version__, torch.__version__)"],
            check=True,
            capture_output=True,
            text=True,
            env=environment(),
        ).stdout.split()
        print(f"transformers: {versions[0]}, torch: {versions[1]} (imported in the child processes)")
        with_pth = make_view(root / "with-pth", site_packages, leave_out=frozenset())
        without_pth = make_view(root / "without-pth", site_packages, leave_out=frozenset({PTH}))
        plain = environment()
        check_views(with_pth, without_pth, plain)
        print("views checked: both see site-packages through site; only one runs the .pth line")

        print(f"\n1. the installed {PTH}, HFPATCH_AUTORUN unset ({args.rounds_pass} rounds)")
        samples = interleaved(
            {
                "with .pth": runner([str(with_pth), "-c", "pass"], plain),
                "without .pth": runner([str(without_pth), "-c", "pass"], plain),
            },
            args.rounds_pass,
            collect=False,
        )
        ratio_rows(
            samples,
            {"with .pth": "python -c pass, with .pth", "without .pth": "python -c pass, without .pth"},
            [("with .pth", "without .pth", None)],
        )
        print(f"\n   ({args.rounds} rounds)")
        samples = interleaved(
            {
                "with .pth": runner([str(with_pth), "-c", IMPORT], plain),
                "without .pth": runner([str(without_pth), "-c", IMPORT], plain),
                "this venv": runner([python, "-c", IMPORT], plain),
            },
            args.rounds,
            collect=False,
        )
        ratio_rows(
            samples,
            {
                "with .pth": f"python -c '{IMPORT}', with .pth",
                "without .pth": f"python -c '{IMPORT}', without .pth",
                "this venv": f"python -c '{IMPORT}', {sys.prefix} itself",
            },
            [("with .pth", "without .pth", 1.02)],
        )
        line = pth_cost(site_packages, 5000)
        implied = (median(samples["without .pth"]) + line) / median(samples["without .pth"])
        print(
            f"   the .pth file itself, processed in-process as site does (site.addpackage): {line * 1e6:.1f} us, i.e. "
            f"{implied:.5f} x 'import transformers' (goal <= 1.02: {'met' if implied <= 1.02 else 'MISSED'}). "
            "With HFPATCH_AUTORUN unset it only reads the environment: nothing it does can slow the import "
            "that follows, so this is the whole cost; the end-to-end ratio above carries the machine's noise."
        )

        print(f"\n2. hfpatch run ({args.rounds} rounds)")
        samples = interleaved(
            {
                "hfpatch run": runner([str(hfpatch), "run", "--", python, "-c", IMPORT], plain),
                "plain": runner([python, "-c", IMPORT], plain),
                "hfpatch run -- true": runner([str(hfpatch), "run", "--", "true"], plain),
                "true": runner(["true"], plain),
            },
            args.rounds,
            collect=False,
        )
        ratio_rows(
            samples,
            {
                "hfpatch run": f"hfpatch run -- python -c '{IMPORT}'",
                "plain": f"python -c '{IMPORT}'",
                "hfpatch run -- true": "hfpatch run -- true (the launcher alone)",
                "true": "true",
            },
            [("hfpatch run", "plain", 1.05), ("hfpatch run -- true", "true", None)],
        )

        print(f"\n3. for information: the child enabling hfpatch ({args.rounds_child} rounds)")
        modeling = "import transformers.modeling_utils"
        samples = interleaved(
            {
                "autorun": runner([python, "-c", modeling], environment(HFPATCH_AUTORUN="1")),
                "plain": runner([python, "-c", modeling], plain),
            },
            args.rounds_child,
            collect=False,
        )
        ratio_rows(
            samples,
            {
                "autorun": f"HFPATCH_AUTORUN=1 python -c '{modeling}' (the hook's stand-ins)",
                "plain": f"python -c '{modeling}'",
            },
            [("autorun", "plain", None)],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
