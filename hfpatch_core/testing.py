"""Proving that a pack keeps a model correct: tiny checkpoints and one assertion.

``tiny_checkpoint(model_type)`` builds a small random checkpoint with
``save_pretrained`` (safetensors), deterministic from a seed.
``assert_pack_equivalent(pack, checkpoint_or_model_type)`` loads it with and without the
pack and checks, reporting every failure at once, that

* the expected classes were replaced, and nothing else;
* no weight is missing or unexpected;
* logits match (fp32 ``atol=1e-5``; bf16 ``atol=BF16_ATOL``) on a padded batch;
* greedy generation of ``generate_tokens`` tokens matches;
* ``save_pretrained`` restores the source layout, and a vanilla reload matches.

A pack that changes outputs on purpose passes ``expect="different"`` (or a larger
``atol``) and keeps the structural and round-trip checks.  When outputs differ, the
message names the first decoder layer and module whose output diverges.

For a pack's own tests: ``load_model`` (a load with the pack enabled, or a vanilla one),
``padded_batch`` and ``logits_of`` (a left-padded batch and its logits),
``safetensors_of`` (the tensors a checkpoint directory holds), ``install_pack`` (a rival
pack from source) and ``discover_from_wheel`` (the pack as ``pip install`` gives it).

The same checks back ``hfpatch verify``; the pytest fixtures live in
``hfpatch_core.pytest_plugin``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from .errors import HfPatchError

#: The logits tolerance used for bfloat16 comparisons (max abs difference of logits of
#: tiny random models; bf16 keeps 8 bits of mantissa, and a reordered sum of a few
#: hundred terms moves the last bit).
BF16_ATOL = 5e-2

#: Values ``tiny_checkpoint`` gives the size fields of a default config, where present.
SHRINK: Mapping[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_window_layers": 2,
    "sliding_window": 64,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
}


class TinyCheckpointError(HfPatchError, ValueError):
    """A model type whose default config cannot be shrunk: pass an explicit config."""


class EquivalenceError(AssertionError):
    """``assert_pack_equivalent`` found one or more problems (all listed in the message)."""

    def __init__(self, failures: Sequence[str]) -> None:
        self.failures = list(failures)
        super().__init__("pack is not equivalent:\n- " + "\n- ".join(self.failures))


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The default config of ``model_type`` with its size fields shrunk (``SHRINK``), then ``overrides``."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise TinyCheckpointError(f"{model_type!r} is not a model type transformers knows")
    defaults = AutoConfig.for_model(model_type)
    values: dict[str, Any] = {}
    for name, value in SHRINK.items():
        current = getattr(defaults, name, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            values[name] = value
    if getattr(defaults, "head_dim", None) is not None:
        hidden = values.get("hidden_size", defaults.hidden_size)
        values["head_dim"] = hidden // values.get("num_attention_heads", defaults.num_attention_heads)
    vocab = values.get("vocab_size", getattr(defaults, "vocab_size", 0))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = getattr(defaults, name, None)
        if isinstance(token, int) and token >= vocab:
            values[name] = vocab - 1
    layers = values.get("num_hidden_layers")
    pattern = getattr(defaults, "layer_types", None)
    if isinstance(layers, int) and isinstance(pattern, list) and "full_attention" in pattern:
        # hybrid models (qwen3_next: 3 linear-attention layers, then 1 full) keep a full-attention layer
        shrunk = list(pattern[:layers])
        if "full_attention" not in shrunk:
            shrunk[-1] = "full_attention"
        values["layer_types"] = shrunk
    values.update(overrides)
    # built anew (not edited) so that derived fields such as layer_types follow the sizes
    try:
        return type(defaults)(**values)
    except Exception as exc:
        raise TinyCheckpointError(
            f"the shrunk default {model_type!r} config is invalid ({type(exc).__name__}: {exc}); "
            "pass an explicit config: tiny_checkpoint(MyConfig(...))"
        ) from exc


def _causal_lm_class(config: Any) -> type[nn.Module]:
    from .inspection import model_class_for

    return model_class_for(config)


def install_pack(
    site: str | Path,
    name: str,
    source: str | None = None,
    *,
    module: str | None = None,
    entry_point: str | None = None,
    distribution: str | None = None,
    version: str = "1.0.0",
    summary: str = "A test pack",
    requires: Sequence[str] = (),
) -> Path:
    """Install a pack written as module source into directory ``site`` as a real distribution.

    Writes ``<module>.py`` and a ``*.dist-info`` whose ``hfpatch.packs`` entry point is
    ``name``, then puts ``site`` first on ``sys.path``: discovery finds the pack
    through ``importlib.metadata`` exactly as it finds a pip-installed one.  Quicker
    than ``install_wheel`` (no build), for rival or helper packs a test defines
    inline, e.g. one that wins a class of the pack under test.

    Args:
        site: the directory (created if needed), a path entry of its own.
        name: the entry-point name (what ``HF_PATCH_PACKS`` selects).
        source: the module's code (dedented); ``None`` to point the entry point at an
            importable module given by ``entry_point``.
        module: the module name; by default ``hfpatch_test_pack_<name>``.
        entry_point: the entry point's value; by default the module.
        distribution: the distribution name; by default ``hfpatch-pack-<name>``.
        version: the distribution version.
        summary: the distribution summary (``hfpatch list`` shows it).
        requires: ``Requires-Dist`` lines besides ``hfpatch-core``
            (``"transformers>=5.3,<6"``).

    Returns:
        The ``*.dist-info`` directory written.

    Raises:
        FileExistsError: ``site`` already holds that distribution.
    """
    import importlib
    import sys
    import textwrap

    site = Path(site)
    site.mkdir(parents=True, exist_ok=True)
    ident = name.replace("-", "_").replace(".", "_")
    module = module or f"hfpatch_test_pack_{ident}"
    distribution = distribution or f"hfpatch-pack-{name}"
    if source is not None:
        module_file = site / f"{module}.py"
        if not module_file.exists():
            module_file.write_text(textwrap.dedent(source))
        # a module of that name imported from an earlier install would shadow this source
        sys.modules.pop(module, None)
    dist_info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {distribution}",
        f"Version: {version}",
        f"Summary: {summary}",
        "Requires-Dist: hfpatch-core",
        *(f"Requires-Dist: {requirement}" for requirement in requires),
    ]
    (dist_info / "METADATA").write_text("\n".join(metadata) + "\n")
    (dist_info / "entry_points.txt").write_text(f"[hfpatch.packs]\n{name} = {entry_point or module}\n")
    (dist_info / "RECORD").write_text("")
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return dist_info


def install_wheel(project: str | Path, site: str | Path, *, timeout: float = 120) -> Path:
    """Build ``project``'s wheel and install it, without dependencies, into directory ``site``.

    What a pack's "discovered from an installed wheel" test needs: put ``site`` first on
    ``PYTHONPATH`` of a subprocess started outside the project's directory, and the pack
    is discovered from the wheel's own metadata.  The wheel is built without build
    isolation where hatchling is importable (offline, and faster).

    Returns:
        The wheel file (kept next to ``site``, in ``<site>-wheels``).

    Raises:
        subprocess.CalledProcessError: pip could not build or install the wheel.
    """
    import importlib.util
    import sys

    site = Path(site)
    wheels = site.with_name(f"{site.name}-wheels")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = [*pip, "wheel", "--no-deps", "--quiet", "-w", str(wheels), str(project)]
    if importlib.util.find_spec("hatchling") is not None:
        build.append("--no-build-isolation")
    subprocess.run(build, check=True, timeout=timeout)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)], check=True, timeout=timeout
    )
    return wheel


def _run_python(
    args: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str], cwd: Path, timeout: float, what: str
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a subprocess; an ``AssertionError`` with its output when it fails."""
    import sys

    command = [sys.executable, *(os.fspath(arg) for arg in args)]
    try:
        return subprocess.run(
            command, env=dict(env), cwd=cwd, capture_output=True, text=True, check=True, timeout=timeout
        )
    except subprocess.CalledProcessError as exc:
        raise AssertionError(
            f"{what} exited with status {exc.returncode}\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{what} did not finish within {timeout:g} s") from exc


@dataclasses.dataclass(frozen=True)
class DiscoveredWheel:
    """What ``discover_from_wheel`` installed and listed, and how to run more probes there.

    Attributes:
        wheel: the wheel file built from the project.
        site: the directory the wheel is installed into (the subprocesses' ``PYTHONPATH``).
        row: the pack's row of ``hfpatch list --json`` (``name``, ``distribution``,
            ``version``, ``enabled``, ``status``, ``transformers``, ``description``).
        env: the environment the listing ran in: this process's, with ``PYTHONPATH`` set
            to ``site`` alone, ``HF_PATCH_PACKS`` to the pack and ``HF_PATCH_STRICT`` unset.
        cwd: the working directory the listing ran in (outside the project).
    """

    wheel: Path
    site: Path
    row: dict[str, Any]
    env: dict[str, str]
    cwd: Path

    def run_python(self, *args: str | os.PathLike[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``python *args`` (``"-c", PROBE, ...``) as the listing ran: same environment and directory.

        Returns:
            The finished process, its output captured as text.

        Raises:
            AssertionError: the process exited with a non-zero status (the message holds its
                stdout and stderr) or ran past ``timeout`` seconds.
        """
        shown = [str(arg) for arg in args]
        if len(shown) > 1 and shown[0] == "-c":
            shown[1] = "<code>"
        return _run_python(args, env=self.env, cwd=self.cwd, timeout=timeout, what=f"python {' '.join(shown)}")


def discover_from_wheel(
    project: str | Path, pack: str, directory: str | Path, *, timeout: float = 120
) -> DiscoveredWheel:
    """Install ``project``'s wheel into ``directory/site`` and list the pack from it in a fresh process.

    The body of a pack's "discovered from an installed wheel" test: ``install_wheel``,
    then ``python -m hfpatch_core list --json`` in a subprocess whose ``PYTHONPATH`` is the
    site alone, started in ``directory`` (not the project's source directory, which would
    shadow the wheel), with ``HF_PATCH_PACKS=pack``.  The test then asserts on the row
    and runs its own probe with ``DiscoveredWheel.run_python``.

    Args:
        project: the pack's project directory (holding its ``pyproject.toml``).
        pack: the pack's entry-point name.
        directory: an empty working directory outside the project (pytest's ``tmp_path``).
        timeout: seconds each build, install and listing may take.

    Returns:
        The wheel, the site, the pack's listed row and the environment of the listing.

    Raises:
        ValueError: ``directory`` is inside ``project``.
        FileExistsError: ``directory/site`` already exists.
        subprocess.CalledProcessError: pip could not build or install the wheel.
        AssertionError: the listing failed, or does not list ``pack`` exactly once.
    """
    import json

    project, directory = Path(project).resolve(), Path(directory).resolve()
    if directory.is_relative_to(project):
        raise ValueError(
            f"{directory} is inside the project {project}: the source there would shadow the installed wheel; "
            "pass a directory outside it (tmp_path)"
        )
    site = directory / "site"
    if site.exists():
        raise FileExistsError(f"{site} already exists: pass a fresh directory for each installed wheel")
    wheel = install_wheel(project, site, timeout=timeout)
    env = {**os.environ, "PYTHONPATH": str(site), "HF_PATCH_PACKS": pack}
    env.pop("HF_PATCH_STRICT", None)
    listing = _run_python(
        ["-m", "hfpatch_core", "list", "--json"], env=env, cwd=directory, timeout=timeout, what="hfpatch list --json"
    )
    packs = json.loads(listing.stdout)["packs"]
    rows = [row for row in packs if row["name"] == pack]
    if len(rows) != 1:
        listed = sorted(row["name"] for row in packs)
        raise AssertionError(
            f"hfpatch list (PYTHONPATH={site}) lists pack {pack!r} {len(rows)} times, expected once; "
            f"it lists {listed} (is {pack!r} the entry-point name in {project / 'pyproject.toml'}?)"
        )
    return DiscoveredWheel(wheel=wheel, site=site, row=rows[0], env=env, cwd=directory)


def tiny_checkpoint(
    model_type_or_config: Any, directory: str | Path | None = None, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Save a small random checkpoint of a model type (or of an explicit config).

    Args:
        model_type_or_config: ``"llama"``, ``"qwen2_moe"``, ... or a config object.
        directory: where to save (default: a new temporary directory).
        seed: the random seed of the weights.
        config_overrides: config fields to set after shrinking.

    Raises:
        TinyCheckpointError: the shrunk default config does not build a model; pass a config.
    """
    if isinstance(model_type_or_config, str):
        config = tiny_config(model_type_or_config, **config_overrides)
    else:
        config = model_type_or_config
        for name, value in config_overrides.items():
            setattr(config, name, value)
    target = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="hfpatch-tiny-"))
    from .scope import vanilla as suspended

    try:
        with suspended():
            torch.manual_seed(seed)
            model: Any = _causal_lm_class(config)(config)
            model.save_pretrained(target)
    except Exception as exc:
        raise TinyCheckpointError(
            f"could not build a tiny {getattr(config, 'model_type', config)!r} checkpoint from its shrunk default "
            f"config ({type(exc).__name__}: {exc}); pass an explicit config: tiny_checkpoint(MyConfig(...))"
        ) from exc
    return target


@dataclasses.dataclass
class Report:
    """What ``check_pack_equivalence`` measured, and every failure it found."""

    pack: str
    model_type: str
    replaced: dict[str, str] = dataclasses.field(default_factory=dict)
    max_abs_diff: float | None = None
    generation_match: bool | None = None
    round_trip: bool | None = None
    failures: list[str] = dataclasses.field(default_factory=list)
    plan: Any = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "plan"}
        fingerprint = self.plan.fingerprint if self.plan is not None else None
        return {**fields, "fingerprint": fingerprint, "ok": self.ok}


@contextlib.contextmanager
def _enabled(packs: str, strict: bool = True) -> Iterator[None]:
    """hfpatch enabled for ``packs`` inside the block; afterwards as it was before."""
    from .hooks import disable, enable
    from .session import active_session

    previous = active_session()
    enable(packs, strict=strict)
    try:
        yield
    finally:
        disable()
        if previous is not None:
            enable(previous.selection.spec.text, strict=previous.strict)


def load_model(
    path: str | Path, packs: str | None = None, *, strict: bool = True, model_class: Any = None, **kwargs: Any
) -> Any:
    """``from_pretrained`` as a user would call it, with hfpatch enabled for ``packs`` or not at all.

    hfpatch is enabled only for the load: afterwards it is as before the call (disabled,
    in a test that starts disabled), also when the load raises.  With ``packs=None`` the
    model is vanilla transformers, also where hfpatch is enabled (``hfpatch run -- pytest``).

    Args:
        path: the checkpoint directory (or hub id).
        packs: which packs to enable, in ``HF_PATCH_PACKS`` syntax (``"my-pack"``,
            ``"qwen-moe,fused-dense@+2"``); ``None`` for a vanilla load.
        strict: make every pack failure an error (not a ``PackWarning``).
        model_class: the class whose ``from_pretrained`` loads (default
            ``AutoModelForCausalLM``).
        kwargs: passed on to ``from_pretrained`` (``dtype=``, ``attn_implementation=``, ...).

    Returns:
        The model, in eval mode (with ``output_loading_info=True``, ``(model, info)``).

    Raises:
        SelectionError: ``packs`` is malformed or names a pack that is not installed.
        PackError: strict mode, and a selected pack failed.
        Exception: whatever ``from_pretrained`` raises.
    """
    from .scope import vanilla as suspended

    if model_class is None:
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM
    with _enabled(packs, strict) if packs is not None else suspended():
        result = model_class.from_pretrained(path, **kwargs)
    # output_loading_info=True gives (model, info)
    (result[0] if isinstance(result, tuple) else result).eval()
    return result


def padded_batch(vocab_size: int, *, pad_token_id: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three random prompts of 12, 8 and 5 tokens, left-padded to 12: ``(input_ids, attention_mask)``.

    The tokens are drawn from ``3 .. vocab_size - 1`` (clear of the usual special ids 0-2),
    deterministic from ``seed``; padded positions hold ``pad_token_id`` and a 0 in the mask.

    Args:
        vocab_size: the model's vocabulary size.
        pad_token_id: the token id of the padding.
        seed: the random seed of the tokens.

    Returns:
        ``input_ids`` and ``attention_mask``, both ``int64`` of shape ``(3, 12)``.

    Raises:
        ValueError: ``vocab_size`` is 3 or less, or ``pad_token_id`` is not in ``0 .. vocab_size - 1``.
    """
    if vocab_size <= 3:
        raise ValueError(f"vocab_size must be above 3 (tokens are drawn from 3 .. vocab_size - 1), got {vocab_size}")
    if not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id {pad_token_id} is not a token of a vocabulary of {vocab_size}")
    ids = torch.randint(3, vocab_size, (3, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids[mask == 0] = pad_token_id
    return ids, mask


def logits_of(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits for a batch, computed without gradients, as float32.

    Returns:
        A tensor of shape ``(batch, seq_len, vocab_size)``.
    """
    with torch.no_grad():
        result: torch.Tensor = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    return result


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, vocab, (2, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded second row
    return ids, mask


def _first_divergence(
    vanilla: nn.Module, patched: nn.Module, ids: torch.Tensor, mask: torch.Tensor, atol: float
) -> str:
    """The first module (in execution order) whose output differs, as 'layer N / module'."""
    records: dict[str, list[tuple[str, torch.Tensor]]] = {"vanilla": [], "patched": []}
    handles = []
    for label, model in (("vanilla", vanilla), ("patched", patched)):
        for name, module in model.named_modules():
            if not name:
                continue

            def hook(_module: nn.Module, _args: Any, output: Any, name: str = name, label: str = label) -> None:
                tensor = output[0] if isinstance(output, (tuple, list)) and output else output
                if isinstance(tensor, torch.Tensor):
                    records[label].append((name, tensor.detach()))

            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            vanilla(input_ids=ids, attention_mask=mask)
            patched(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    reference = dict(records["vanilla"])
    for name, tensor in records["patched"]:
        expected = reference.get(name)
        if expected is None or expected.shape != tensor.shape:
            continue
        difference = (expected.float() - tensor.float()).abs().max().item()
        if difference > atol:
            parts = name.split(".")
            layer = next((f"layer {parts[i + 1]}" for i, p in enumerate(parts[:-1]) if p == "layers"), "outside layers")
            return f"{layer}, module {name} ({type(tensor).__name__} max abs diff {difference:.3g})"
    return "no single module diverges beyond atol (the difference builds up across modules)"


def safetensors_of(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``directory`` (a saved checkpoint), by name.

    Compare a ``save_pretrained`` output with its source: names, shapes, dtypes, values.

    Returns:
        Tensor name -> tensor, read from all the files (sharded checkpoints included).

    Raises:
        FileNotFoundError: ``directory`` holds no ``*.safetensors`` file (or does not exist).
    """
    from safetensors import safe_open

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        state = "does not exist" if not directory.exists() else "holds no *.safetensors file"
        raise FileNotFoundError(f"{directory} {state}: is it a checkpoint saved with safetensors?")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                found[key] = handle.get_tensor(key)
    return found


def check_pack_equivalence(
    pack: str,
    checkpoint_or_model_type: str | Path,
    *,
    atol: float | None = None,
    expect: Literal["same", "different"] = "same",
    dtype: torch.dtype = torch.float32,
    generate_tokens: int = 20,
    expected_replacements: Sequence[str] | None = None,
) -> Report:
    """Run every check of ``assert_pack_equivalent`` and return the report."""
    from transformers import AutoModelForCausalLM

    from .plan import plan_of

    source = Path(checkpoint_or_model_type)
    if not source.is_dir():
        source = tiny_checkpoint(str(checkpoint_or_model_type))
    tolerance = atol if atol is not None else (BF16_ATOL if dtype == torch.bfloat16 else 1e-5)
    from .scope import vanilla as suspended

    with suspended():  # the reference is vanilla even where hfpatch is enabled (hfpatch run -- pytest)
        vanilla: Any = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    model_type = str(vanilla.config.model_type)
    report = Report(pack=pack, model_type=model_type)
    fail = report.failures.append
    try:
        with _enabled(pack):
            loaded: Any = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, output_loading_info=True)
            patched: Any = loaded[0]
            info: dict[str, Any] = loaded[1]
    except Exception as exc:
        fail(f"loading with pack {pack!r} failed: {type(exc).__name__}: {exc}")
        return report
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(key) for key in info.get(kind) or ())
        if keys:
            fail(f"weights {kind.replace('_', ' ')}: {', '.join(keys[:10])}")

    plan = report.plan = plan_of(patched)
    vanilla_types = dict(vanilla.named_modules())
    replaced_paths: list[str] = []
    for name, module in patched.named_modules():
        original = vanilla_types.get(name)
        if original is None or type(original) is type(module):
            continue
        if any(name.startswith(path + ".") for path in replaced_paths):
            continue
        replaced_paths.append(name)
        report.replaced.setdefault(type(original).__name__, type(module).__name__)
        claim = plan.replaced.get(type(original).__name__) if plan is not None else None
        if claim is None or claim.patch.replacement is not type(module):
            fail(f"{name}: {type(original).__name__} became {type(module).__name__}, which the plan does not say")
    if expected_replacements is not None and sorted(report.replaced) != sorted(expected_replacements):
        fail(f"replaced classes {sorted(report.replaced)}, expected {sorted(expected_replacements)}")
    if not report.replaced:
        fail(f"pack {pack!r} replaced no class of this {model_type} model")

    ids, mask = _inputs(int(vanilla.config.vocab_size))
    reference, logits = logits_of(vanilla, ids, mask), logits_of(patched, ids, mask)
    report.max_abs_diff = (reference - logits).abs().max().item()
    if expect == "same" and report.max_abs_diff > tolerance:
        where = _first_divergence(vanilla, patched, ids, mask, tolerance)
        fail(f"logits differ: max abs diff {report.max_abs_diff:.3g} > atol {tolerance:g}; first divergence: {where}")

    if generate_tokens and expect == "same":
        settings = {"max_new_tokens": generate_tokens, "do_sample": False, "pad_token_id": 0}
        with torch.no_grad():
            a = vanilla.generate(ids[:1], attention_mask=mask[:1], **settings)
            b = patched.generate(ids[:1], attention_mask=mask[:1], **settings)
        report.generation_match = bool(torch.equal(a, b))
        if not report.generation_match:
            fail(f"greedy generation of {generate_tokens} tokens differs: {a.tolist()} vs {b.tolist()}")

    with tempfile.TemporaryDirectory(prefix="hfpatch-roundtrip-") as saved:
        try:
            patched.save_pretrained(saved)
        except Exception as exc:
            report.round_trip = False
            fail(f"save_pretrained failed: {type(exc).__name__}: {exc}")
        else:
            written = safetensors_of(saved)
            try:
                original = safetensors_of(source)
            except FileNotFoundError as exc:  # a checkpoint in another format: no layout to compare
                original = {}
                report.round_trip = False
                fail(f"the saved layout cannot be compared with the source: {exc}")
            layout = [
                key
                for key in sorted(set(original) | set(written))
                if key not in original
                or key not in written
                or original[key].shape != written[key].shape
                or not torch.equal(original[key].to(written[key].dtype), written[key])
            ]
            if original:
                report.round_trip = not layout
                if layout:
                    fail(f"save_pretrained does not restore the source layout: {', '.join(layout[:10])}")
            with suspended():
                reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=dtype)
            again = logits_of(reloaded, ids, mask)
            if expect == "same" and (again - reference).abs().max().item() > tolerance:
                report.round_trip = False
                fail("a vanilla reload of the saved checkpoint gives different logits")
    return report


def assert_pack_equivalent(
    pack: str,
    checkpoint_or_model_type: str | Path,
    *,
    atol: float | None = None,
    expect: Literal["same", "different"] = "same",
    dtype: torch.dtype = torch.float32,
    generate_tokens: int = 20,
    expected_replacements: Sequence[str] | None = None,
) -> Report:
    """Assert that pack ``pack`` keeps a model correct (see the module docstring).

    Args:
        pack: the pack's name (its entry point name), installed in this environment.
        checkpoint_or_model_type: a checkpoint directory, or a model type for a tiny one.
        atol: the logits tolerance (default 1e-5 in fp32, ``BF16_ATOL`` in bf16).
        expect: ``"different"`` for a pack that changes outputs on purpose.
        dtype: the dtype to load both models in.
        generate_tokens: how many greedy tokens to compare (0 to skip).
        expected_replacements: the original class names the pack must replace.

    Raises:
        EquivalenceError: listing every failed check.
    """
    report = check_pack_equivalence(
        pack,
        checkpoint_or_model_type,
        atol=atol,
        expect=expect,
        dtype=dtype,
        generate_tokens=generate_tokens,
        expected_replacements=expected_replacements,
    )
    if report.failures:
        raise EquivalenceError(report.failures)
    return report
