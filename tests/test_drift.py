"""The drift guard: a pack's record of the signatures it was built against, and ``hfpatch check``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from transformers.models.llama.modeling_llama import LlamaMLP

from hfpatch_core.authoring.drift import (
    DriftRecord,
    RecordError,
    Target,
    compare,
    read_record,
    record_path,
    signature_text,
)
from packs import MLP_PACK, PackSpec

INSTALLED = transformers.__version__


def test_signatures_leave_out_annotations_and_addresses() -> None:
    def forward(self, x: int, *rest: str, scale: float = 1.0, hook: object = object(), **kwargs: int) -> int:
        return x

    assert signature_text(forward) == "(self, x, *rest, scale=1.0, hook=<object>, **kwargs)"
    assert Target.of("llama", LlamaMLP) == Target("llama", "LlamaMLP", "(self, x)", "(self, config)")


def test_a_pass_through_init_wrapper_is_seen_through() -> None:
    # what transformers' use_kernelized_func does to an attention class when kernels is installed
    class Attention(LlamaMLP):
        def __init__(self, config, layer_idx=0):
            super().__init__(config)

    original = Attention.__init__

    def new_init(self, *args, **kwargs):
        original(self, *args, **kwargs)

    Attention.__init__ = new_init  # type: ignore[method-assign]
    assert Target.of("llama", Attention).init == "(self, config, layer_idx=0)"

    def unrelated(self, *args, **kwargs):  # a closure over nothing called __init__ stays as it is
        return args

    Attention.__init__ = unrelated  # type: ignore[method-assign]
    assert Target.of("llama", Attention).init == "(self, *args, **kwargs)"


def test_the_record_file_sits_beside_the_module(tmp_path: Path) -> None:
    assert record_path(tmp_path / "pkg" / "__init__.py") == tmp_path / "pkg" / "hfpatch-record.json"
    assert record_path(tmp_path / "hfpatch_pack_x.py") == tmp_path / "hfpatch_pack_x.hfpatch-record.json"


def test_a_record_writes_the_same_bytes_and_reads_back(tmp_path: Path) -> None:
    mlp, norm = Target("llama", "LlamaMLP", "(self, x)", "(self, config)"), Target("llama", "Norm", "(self, h)", "(s)")
    record = DriftRecord("p", {}).with_release("5.25.0", [mlp, norm]).with_release("5.3.0", [norm, mlp])
    assert list(record.to_json()["releases"]) == ["5.3.0", "5.25.0"]  # version order, not text order
    path = tmp_path / "r.json"
    path.write_text(record.dumps())
    again = read_record(path)
    assert again == record and again.dumps() == record.dumps()
    assert read_record(tmp_path / "missing.json") is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not JSON"),
        ('{"format": 2, "pack": "p", "releases": {}}', "not an hfpatch record of format 1 (found 2)"),
        ('{"format": 1, "pack": "p", "releases": {"five": []}}', "'five' is not a transformers version"),
        ('{"format": 1, "pack": "p", "releases": {"5.3.0": [{"class": "X"}]}}', "needs ('model_type', 'class'"),
    ],
)
def test_a_bad_record_says_what_is_wrong_and_how_to_fix_it(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "hfpatch-record.json"
    path.write_text(content)
    with pytest.raises(RecordError, match="hfpatch check --record") as raised:
        read_record(path)
    assert message in str(raised.value) and str(path) in str(raised.value)


def test_compare_accepts_any_recorded_signature_and_names_what_changed() -> None:
    old = Target("m", "A", "(self, x, cache_position=None)", "(self, config)")
    new = Target("m", "A", "(self, x, cache=None)", "(self, config)")
    gone = Target("m", "B", "(self)", "(self)")
    record = DriftRecord("p", {}).with_release("5.3.0", [old, gone]).with_release("5.25.0", [new])
    assert compare(record, [new], "5.25.0") == ()
    assert compare(record, [old, gone], "5.13.0") == ()  # 5.3's signatures: the pack was built against them
    changed = Target("m", "A", "(self, x, cache=None, extra=1)", "(self, config, layer_idx)")
    drifts = compare(record, [changed], "5.26.0")
    assert [(d.change, d.recorded_on, d.installed, d.recorded, d.now) for d in drifts] == [
        ("forward", "5.25.0", "5.26.0", "(self, x, cache=None)", "(self, x, cache=None, extra=1)"),
        ("__init__", "5.25.0", "5.26.0", "(self, config)", "(self, config, layer_idx)"),
    ]
    assert drifts[0].describe() == (
        "drift: A (m) forward changed (recorded on transformers 5.25.0, installed 5.26.0): "
        "was (self, x, cache=None), is now (self, x, cache=None, extra=1)"
    )
    # on 5.4 the nearest recorded release is 5.3, whose class B the pack no longer finds
    on_5_4 = compare(record, [new, Target("m", "C", "(self)", "(self)")], "5.4.0")
    assert [(d.class_name, d.change, d.recorded_on) for d in on_5_4] == [("C", "new", "5.3.0"), ("B", "gone", "5.3.0")]


def _record_of(site: Path) -> Path:
    return site / "hfpatch_test_pack_mlp.hfpatch-record.json"  # a single-module pack


def test_check_states_a_missing_record_and_records_one_that_keeps_it_clean(install, capsys) -> None:
    from hfpatch_core.cli import main

    site = install(PackSpec("mlp", MLP_PACK))
    assert main(["check", "mlp"]) == 0  # no record is said, not a failure
    assert capsys.readouterr().out == (
        "ok    mlp 1.0.0: targets llama\n"
        "      no drift record: `hfpatch check --record mlp` writes one (not a failure)\n"
    )
    assert main(["check", "--record", "mlp"]) == 0
    assert capsys.readouterr().out == (
        f"ok    mlp 1.0.0: targets llama\n      recorded 1 class on transformers {INSTALLED} in {_record_of(site)}\n"
    )
    written = json.loads(_record_of(site).read_text())
    assert written == {
        "format": 1,
        "pack": "mlp",
        "releases": {
            INSTALLED: [
                {"model_type": "llama", "class": "LlamaMLP", "forward": "(self, x)", "__init__": "(self, config)"}
            ]
        },
    }
    assert main(["check", "mlp"]) == 0  # unchanged: clean
    assert capsys.readouterr().out == "ok    mlp 1.0.0: targets llama\n"


def test_check_fails_a_pack_whose_target_changed_since_its_record(install, capsys) -> None:
    from hfpatch_core.cli import main

    site = install(PackSpec("mlp", MLP_PACK))
    recorded = Target("llama", "LlamaMLP", "(self, hidden_states)", "(self, config)")
    _record_of(site).write_text(DriftRecord("mlp", {}).with_release("5.0.0", [recorded]).dumps())
    assert main(["check", "mlp"]) == 1
    assert capsys.readouterr().out == (
        "FAIL  mlp 1.0.0: targets llama\n"
        f"      - drift: LlamaMLP (llama) forward changed (recorded on transformers 5.0.0, installed {INSTALLED}): "
        "was (self, hidden_states), is now (self, x)\n"
        "      verify the pack on this release, then `hfpatch check --record mlp` adds it to the record\n"
    )
    assert main(["check", "--record", "mlp"]) == 0  # the author refreshes it: both releases are kept
    capsys.readouterr()
    assert list(json.loads(_record_of(site).read_text())["releases"]) == ["5.0.0", INSTALLED]
    assert main(["check", "mlp"]) == 0


def test_a_broken_record_is_a_problem_of_the_pack(install, capsys) -> None:
    from hfpatch_core.cli import main

    site = install(PackSpec("mlp", MLP_PACK))
    _record_of(site).write_text("[]")
    assert main(["check", "mlp"]) == 1
    assert f"      - pack 'mlp': {_record_of(site)}: not an hfpatch record of format 1" in capsys.readouterr().out
    assert main(["check", "--record", "mlp"]) == 1  # a record with problems is not overwritten
    assert "not recorded: pack 'mlp' has problems" in capsys.readouterr().out
    assert _record_of(site).read_text() == "[]"


TWO_TYPES_PACK = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaMLP

    class PackMLP(LlamaMLP):
        pass

    @hookimpl
    def provide_patches(context):
        names = {"llama": "LlamaMLP", "mistral": "MistralMLP"}
        return [Patch(names[context.model_type], PackMLP)] if context.model_type in names else []
"""


def test_recording_some_model_types_keeps_the_others_of_that_release(install, capsys) -> None:
    from hfpatch_core.cli import main

    site = install(PackSpec("two", TWO_TYPES_PACK))
    record = site / "hfpatch_test_pack_two.hfpatch-record.json"
    assert main(["check", "--record", "two"]) == 0
    both = json.loads(record.read_text())["releases"][INSTALLED]
    assert [(entry["model_type"], entry["class"]) for entry in both] == [
        ("llama", "LlamaMLP"),
        ("mistral", "MistralMLP"),
    ]
    assert main(["check", "--record", "two", "--model-type", "llama"]) == 0
    assert json.loads(record.read_text())["releases"][INSTALLED] == both
    capsys.readouterr()


#: Claims the class of each model's final norm, whatever it is called, for two model types whose
#: load builds classes of another modeling module: gemma3_text loads Gemma3ForCausalLM (of
#: modeling_gemma3), exaone loads LlamaForCausalLM.
BORROWED_NORM_PACK = """
    from hfpatch_core import Patch, hookimpl
    from hfpatch_core.authoring import build_on_meta
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    TYPES = [model_type for model_type in ("gemma3_text", "exaone") if model_type in CONFIG_MAPPING_NAMES]

    @hookimpl
    def provide_model_types():
        return TYPES

    @hookimpl
    def provide_patches(context):
        if context.model_type not in TYPES or context.config is None:
            return []
        norm = type(build_on_meta(context).model.norm)
        return [Patch(norm.__name__, type("Functional" + norm.__name__, (norm,), {}))]
"""


def test_check_resolves_classes_as_a_load_does_and_records_them(install, capsys) -> None:
    """A class reached through another modeling module is a target, as transformers' patch registry
    applies it; it was flagged as matching nothing, and ``--record`` refused to write (issue 38.6)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hfpatch_core._pipeline.model_types import modeling_module_classes
    from hfpatch_core.cli import main

    expected = {("gemma3_text", "Gemma3RMSNorm"), ("exaone", "LlamaRMSNorm")}  # exaone is not in 5.3
    expected = {(model_type, name) for model_type, name in expected if model_type in CONFIG_MAPPING_NAMES}
    types = ", ".join(model_type for model_type in ("gemma3_text", "exaone") if model_type in CONFIG_MAPPING_NAMES)
    site = install(PackSpec("borrowed", BORROWED_NORM_PACK))
    assert main(["check", "--record", "borrowed"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.startswith(f"ok    borrowed 1.0.0: targets {types}\n"), out
    record = json.loads((site / "hfpatch_test_pack_borrowed.hfpatch-record.json").read_text())
    recorded = {(target["model_type"], target["class"]) for target in record["releases"][INSTALLED]}
    assert recorded == expected
    # neither class is in its model type's own modeling module (gemma3_text and exaone have none of their own)
    assert all(name not in modeling_module_classes(model_type) for model_type, name in recorded)
    assert main(["check", "borrowed"]) == 0
    assert capsys.readouterr().out == f"ok    borrowed 1.0.0: targets {types}\n"
