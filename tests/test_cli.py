from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import transformers

import hfpatch_core
from packs import (
    DETACHED_PACK,
    DOUBLING_PACK,
    MLP_PACK,
    NORM_PATTERN_PACK,
    PackSpec,
    fused_attention_and_mlp_pack,
    mlp_pack,
)

HFPATCH = str(Path(sys.executable).with_name("hfpatch"))
#: A source checkout under test (PYTHONPATH=. in it) stays first on the subprocesses' path.
_ROOT = Path(hfpatch_core.__file__).resolve().parents[1]
CHECKOUT = str(_ROOT) if (_ROOT / "pyproject.toml").is_file() else ""


def environment_with(site: Path | None) -> dict[str, str]:
    """This process's environment without hfpatch's variables, packs from ``site`` only."""
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith(("HF_PATCH", "HFPATCH")) or k == "HF_PATCH_CACHE"
    }
    environment["PYTHONPATH"] = os.pathsep.join(path for path in (str(site) if site else "", CHECKOUT) if path)
    return environment


def run(*args: str, site: Path | None = None, env: dict[str, str] | None = None, timeout: int = 120):
    environment = environment_with(site)
    environment.update(env or {})
    return subprocess.run(args, capture_output=True, text=True, env=environment, timeout=timeout, check=False)


@pytest.mark.release_independent
def test_list_shows_every_pack_and_why(install) -> None:
    site = install(
        PackSpec("mlp", MLP_PACK, version="1.2.0", summary="Faster MLP"),
        PackSpec("future", MLP_PACK, requires=("transformers>=6",)),
        PackSpec("exploding", "raise RuntimeError('imported!')\n"),
    )
    result = run(HFPATCH, "list", "--json", site=site, env={"HF_PATCH_PACKS": "all,-exploding"})
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)["packs"]}
    assert rows["mlp"] == {
        "name": "mlp",
        "distribution": "hfpatch-pack-mlp",
        "version": "1.2.0",
        "required_by": [],
        "enabled": True,
        "status": "enabled",
        "transformers": "<6,>=5.3",
        "description": "Faster MLP",
    }
    assert rows["future"]["status"].startswith("skipped: needs transformers>=6") and not rows["future"]["enabled"]
    assert rows["exploding"]["status"] == "disabled: excluded by HF_PATCH_PACKS='all,-exploding'"
    text = run(HFPATCH, "list", site=site).stdout
    assert "mlp" in text and "Faster MLP" in text and "skipped: needs transformers>=6" in text
    assert "'enabled' packs are selected; hfpatch check imports them" in text
    # issue 52.8: with HF_PATCH_PACKS unset the commands show every pack enabled, as enable() selects,
    # while a program that does not enable hfpatch loads vanilla: the listing says so
    assert "HF_PATCH_PACKS is unset: they run under enable() or hfpatch run; a program that does neither" in text
    named = run(HFPATCH, "list", "--no-conflicts", site=site, env={"HF_PATCH_PACKS": "all,-exploding"}).stdout
    assert "'enabled' packs are selected" in named and "is unset" not in named  # a set selection runs anywhere


def test_bad_selection_is_one_line_and_exit_2(install) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    result = run(HFPATCH, "list", site=site, env={"HF_PATCH_PACKS": "mpl"})
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "hfpatch: error: HF_PATCH_PACKS='mpl' names pack 'mpl', which is not installed (installed packs: "
    )
    assert "mlp" in lines[0] and lines[0].endswith("; did you mean 'mlp'?")
    debug = run(HFPATCH, "--debug", "list", site=site, env={"HF_PATCH_PACKS": "mpl"})
    assert "Traceback" in debug.stderr


def test_explain_a_checkpoint_shows_replacements_losers_and_nesting(install, llama_checkpoint) -> None:
    site = install(
        PackSpec("mlp", MLP_PACK),
        PackSpec("norm", NORM_PATTERN_PACK),
        PackSpec("broad", mlp_pack("BroadMLP", target="MLP$")),
    )
    result = run(HFPATCH, "explain", str(llama_checkpoint), "--json", site=site)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    classes = {row["class"]: row for row in data["classes"]}
    assert classes["LlamaMLP"]["replaced_by"]["pack"] == "mlp"
    assert classes["LlamaRMSNorm"]["replaced_by"]["replacement"] == "hfpatch_test_pack_norm.PackNorm"
    assert classes["LlamaRMSNorm"]["count"] == 2 * 2 + 1
    assert classes["LlamaAttention"]["replaced_by"] is None
    assert any("broad" in text and "an exact name" in text for text in classes["LlamaMLP"]["lost"])
    assert data["model_class"] == "LlamaForCausalLM" and len(data["fingerprint"]) == 12
    text = run(HFPATCH, "explain", "llama", site=site).stdout
    assert "LlamaMLP" in text and "PackMLP [mlp 1.0.0]" in text and "Claims that lost or are shadowed" in text


NESTING_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.bert.modeling_bert import BertAttention, BertSelfAttention

class AnyAttention(BertAttention):
    pass

class SelfAttention(BertSelfAttention):
    pass

@hookimpl
def provide_patches(context):
    if context.model_type != "bert":
        return []
    return [Patch(".*Attention$", AnyAttention), Patch("BertSelfAttention", SelfAttention)]
"""


@pytest.mark.release_independent
def test_explain_warns_when_a_pattern_replaces_a_class_containing_another(install) -> None:
    site = install(PackSpec("attn", NESTING_PACK))
    data = json.loads(run(HFPATCH, "explain", "bert", "--json", site=site).stdout)
    assert any(
        "'.*Attention$'" in w and "replaces BertAttention, which contains BertSelfAttention" in w
        for w in data["warnings"]
    )


@pytest.mark.release_independent
def test_explain_unknown_model_suggests_close_names(install) -> None:
    result = run(HFPATCH, "explain", "lama", site=install(PackSpec("mlp", MLP_PACK)))
    assert result.returncode == 2
    assert "'lama' is neither a checkpoint directory nor a model type" in result.stderr and "'llama'" in result.stderr


def test_check_passes_a_good_pack_and_fails_a_bad_target(install) -> None:
    site = install(
        PackSpec("mlp", MLP_PACK),
        PackSpec("renamed", mlp_pack("RenamedMLP", target="LlamaFeedForward")),
        PackSpec("broken", "raise ImportError('missing kernel')\n"),
        PackSpec("typo", fused_attention_and_mlp_pack(mlp_targets="('LlamaMlp',)")),
    )
    good = run(HFPATCH, "check", "mlp", site=site)
    assert good.returncode == 0 and "ok    mlp 1.0.0: targets llama" in good.stdout
    bad = run(HFPATCH, "check", site=site)
    assert bad.returncode == 1
    assert "patch target 'LlamaFeedForward' matches no module class a llama load reads" in bad.stdout
    assert "failed to import 'hfpatch_test_pack_broken': ImportError: missing kernel" in bad.stdout
    assert "converter for 'llama' names patch target 'LlamaMlp', but the pack returned no patch for it" in bad.stdout


CONFIG_ONLY_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class SizedMLP(LlamaMLP):
    pass

@hookimpl
def provide_patches(context):
    # decides from the config, as a pack that reads sizes does
    if context.model_type == "llama" and context.config is not None:
        return [Patch("LlamaMLP", SizedMLP)]
    return []
"""


NOTHING_PACK = """
from hfpatch_core import hookimpl

@hookimpl
def provide_patches(context):
    return []
"""

DECLARING_PACK = (
    CONFIG_ONLY_PACK
    + """

@hookimpl
def provide_model_types():
    return ["llama", "lama"]
"""
)


def test_check_finds_what_a_pack_that_needs_a_config_targets(install, capsys) -> None:
    from hfpatch_core.cli import main  # in-process: the probe's tiny configs are built once

    install(PackSpec("sized", CONFIG_ONLY_PACK), PackSpec("nothing", NOTHING_PACK))
    assert main(["check", "sized"]) == 0  # asked with a tiny config of every model type
    assert capsys.readouterr().out == (
        "ok    sized 1.0.0: targets llama\n"
        "      no drift record: `hfpatch check --record sized` writes one (not a failure)\n"
    )
    assert main(["check", "nothing"]) == 1  # passing while testing nothing is a failure
    found = capsys.readouterr().out
    assert "FAIL  nothing 1.0.0: targets no model type" in found and "nothing was checked" in found
    assert main(["check", "sized", "--model-type", "llama"]) == 0
    assert "ok    sized 1.0.0: targets llama" in capsys.readouterr().out
    assert main(["check", "sized", "--model-type", "mistral"]) == 1
    assert "pack 'sized' returns no patch and no converter for mistral" in capsys.readouterr().out


CHOOSY_PACK = """
from hfpatch_core import Patch, Refusal, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class SizedMLP(LlamaMLP):
    pass

@hookimpl
def provide_patches(context):
    # decides from the config, as a structural pack does: claims llama's MLP, refuses mistral's
    if context.config is None:
        return []
    if context.model_type == "llama":
        return [Patch("LlamaMLP", SizedMLP)]
    if context.model_type == "mistral":
        return [Refusal("MistralMLP", "REASON")]
    return []
"""


def test_check_shows_where_a_pack_only_refuses_and_keeps_its_answers_until_its_source_changes(install, capsys) -> None:
    import importlib.util

    from hfpatch_core.cli import main

    site = install(PackSpec("choosy", CHOOSY_PACK.replace("REASON", "its sizes differ")))
    assert main(["check", "choosy"]) == 0
    assert capsys.readouterr().out == (
        "ok    choosy 1.0.0: targets llama, mistral\n"
        "      refused (left as it is): mistral: MistralMLP: its sizes differ\n"
        "      no drift record: `hfpatch check --record choosy` writes one (not a failure)\n"
    )
    cached = list(Path(os.environ["HF_PATCH_CACHE"]).glob("pack-answers-*.json"))
    assert len(cached) == 1 and "its sizes differ" in cached[0].read_text()
    # an author's edit (an editable install's RECORD lists no source) is asked anew, not read from the cache
    spec = importlib.util.find_spec("hfpatch_test_pack_choosy")
    assert spec is not None and spec.origin is not None and Path(spec.origin).is_relative_to(site)
    Path(spec.origin).write_text(CHOOSY_PACK.replace("REASON", "it gates"))
    for module in [name for name in sys.modules if name.startswith("hfpatch_test_pack_choosy")]:
        del sys.modules[module]
    assert main(["check", "choosy"]) == 0
    assert "refused (left as it is): mistral: MistralMLP: it gates\n" in capsys.readouterr().out
    kept = cached[0].read_text()  # the answers before the edit are forgotten, not kept beside
    assert "it gates" in kept and "its sizes differ" not in kept


@pytest.mark.release_independent
def test_check_help_says_it_checks_the_selection(capsys) -> None:
    from hfpatch_core.cli import main

    with pytest.raises(SystemExit):
        main(["check", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: the packs HF_PATCH_PACKS selects, as for a load)" in shown and "all installed" not in shown


def test_a_pack_can_declare_its_model_types(install, capsys) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("declaring", DECLARING_PACK))
    assert main(["check", "declaring"]) == 1
    found = capsys.readouterr().out
    assert "FAIL  declaring 1.0.0: targets llama\n" in found
    assert "pack 'declaring' declares model type 'lama': 'lama' is not a model type" in found


def test_an_unknown_model_type_is_bad_input_said_once(install, capsys) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("mlp", MLP_PACK), PackSpec("sized", CONFIG_ONLY_PACK))
    for command in ("check", "verify"):
        assert main([command, "--model-type", "llama", "--model-type", "lama"]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (
            f"hfpatch: error: --model-type 'lama' is not a model type of transformers {transformers.__version__}; "
            "did you mean 'llama', 'mllama', 'llama4'?\n"
        )


def test_check_several_packs_checks_them_together(install, capsys) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("mlp", MLP_PACK), PackSpec("other", mlp_pack("OtherMLP")), PackSpec("norm", NORM_PATTERN_PACK))
    assert main(["check", "mlp", "norm"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ok    together: mlp, norm"
    assert main(["check", "mlp", "other"]) == 1  # each is fine alone; every llama load would raise
    found = capsys.readouterr().out
    assert "ok    mlp 1.0.0: targets llama" in found and "ok    other 1.0.0: targets llama" in found
    assert "FAIL  together: mlp, other" in found
    assert "mlp + other on llama: every load of a llama model would raise" in found
    assert "packs 'mlp' and 'other' both replace 'LlamaMLP'" in found and "HF_PATCH_PACKS=mlp@+1,other " in found
    assert main(["check", "mlp@+1", "other"]) == 0  # the fix it names, checked by the resolver


BROAD_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class AnyMLP(LlamaMLP):
    pass

@hookimpl
def provide_patches(context):
    return [Patch("Llama.*", AnyMLP)] if context.model_type == "llama" else []
"""


def test_check_flags_a_pattern_that_replaces_a_model_class_or_a_container(install, capsys) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("broad", BROAD_PACK), PackSpec("attn", NESTING_PACK))
    assert main(["check", "broad"]) == 1
    found = capsys.readouterr().out
    assert "pattern 'Llama.*' matches the model classes LlamaForCausalLM" in found
    assert "a load would replace the model itself with hfpatch_test_pack_broad.AnyMLP" in found
    assert main(["check", "attn"]) == 1
    assert "'.*Attention$' of pack 'attn' replaces BertAttention, which contains BertSelfAttention" in (
        capsys.readouterr().out
    )


@pytest.mark.release_independent
def test_cli_warnings_are_one_line_each(install) -> None:
    site = install(PackSpec("mlp", MLP_PACK), PackSpec("future", MLP_PACK, requires=("transformers>=6",)))
    result = run(HFPATCH, "explain", "llama", site=site)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"hfpatch: warning: pack 'future' (hfpatch-pack-future 1.0.0) supports transformers>=6 but "
        f"{transformers.__version__} is installed; it is skipped. Install a release of hfpatch-pack-future "
        f"made for transformers {transformers.__version__}, or disable it with HF_PATCH_PACKS=all,-future."
    ]
    # the format is the command's: importing the library (or the CLI module) leaves Python's in place
    code = (
        "import warnings; import hfpatch_core, hfpatch_core.cli.parser; from hfpatch_core.cli import main; "
        "before = warnings.showwarning; main(['list']); assert warnings.showwarning is before; "
        "print(before.__module__)"
    )
    library = run(sys.executable, "-c", code, site=site)
    assert library.returncode == 0 and library.stdout.splitlines()[-1] == "warnings", library.stderr


def test_check_together_reports_only_what_the_packs_do_together(install, capsys) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("broad", BROAD_PACK), PackSpec("mlp", MLP_PACK))
    assert main(["check", "broad", "mlp"]) == 1
    found = capsys.readouterr().out
    # broad's pattern matches the model class whoever else is installed: reported under broad, once
    assert found.count("pattern 'Llama.*' matches the model classes") == 1
    together = found.split("FAIL  together: broad, mlp\n", 1)[1]
    # what mlp adds: a class the pattern's replacement contains is replaced by another pack
    prefix = "      - broad + mlp on llama: pattern 'Llama.*' of pack 'broad' replaces LlamaForCausalLM"
    assert together.startswith(prefix)
    assert "(by 'broad''s AnyMLP, 'mlp''s PackMLP)" in together


@pytest.mark.release_independent
def test_explain_prints_a_patterns_nesting_warning_once(install) -> None:
    site = install(PackSpec("broad", BROAD_PACK))
    result = run(HFPATCH, "explain", "llama", site=site)
    assert result.returncode == 0, result.stderr
    (warning,) = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert "replaces LlamaForCausalLM, which contains LlamaModel, LlamaDecoderLayer" in warning


def test_verify_fails_a_selected_pack_it_cannot_verify(install, capsys) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("nothing", NOTHING_PACK))
    assert main(["verify", "nothing"]) == 1
    found = capsys.readouterr().out
    assert "nothing: not verified: pack 'nothing' targets no model type" in found and "--model-type TYPE" in found


def test_verify_bad_input_is_one_line_and_exit_2_before_any_work(install, capsys, monkeypatch, tmp_path) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("mlp", MLP_PACK))
    monkeypatch.delenv("HF_PATCH_PACKS", raising=False)
    monkeypatch.setattr("hfpatch_core.testing.tiny_checkpoint", _no_checkpoint)
    assert main(["verify", "mlp", "--model", str(tmp_path / "nope")]) == 2
    missing = capsys.readouterr()
    assert missing.out == "" and len(missing.err.strip().splitlines()) == 1
    assert "nope': the path does not exist; give a local checkpoint directory" in missing.err
    assert "--model-type TYPE" in missing.err and "model type of" not in missing.err
    assert main(["verify", "mlp", "--model", str(tmp_path)]) == 2
    assert "no config.json in it" in capsys.readouterr().err
    # the names came from the command line: the message says so, not HF_PATCH_PACKS (which is unset)
    assert main(["verify", "mpl"]) == 2
    typo = capsys.readouterr()
    assert typo.out == "" and "HF_PATCH_PACKS" not in typo.err
    assert typo.err.startswith("hfpatch: error: hfpatch verify 'mpl' names pack 'mpl', which is not installed")
    assert typo.err.rstrip().endswith("did you mean 'mlp'?")
    assert main(["check", "mpl"]) == 2
    assert capsys.readouterr().err.startswith("hfpatch: error: hfpatch check 'mpl' names pack 'mpl'")


def _no_checkpoint(*args: object, **kwargs: object) -> None:
    raise AssertionError("a checkpoint was built for bad input")


PROGRAM = """
import subprocess, sys, tempfile
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path)
print("parent", type(model.model.layers[0].mlp).__name__)
if sys.argv[2:] == ["spawn"]:
    child = subprocess.run([sys.executable, __file__, path], capture_output=True, text=True)
    print(child.stdout.strip().replace("parent", "child"))
"""


@pytest.mark.release_independent
def test_run_enables_packs_in_the_program_and_its_children(install, llama_checkpoint, tmp_path) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    program = tmp_path / "train.py"
    program.write_text(textwrap.dedent(PROGRAM))
    plain = run(sys.executable, str(program), str(llama_checkpoint), site=site)
    assert plain.stdout.split() == ["parent", "LlamaMLP"], plain.stderr
    wrapped = run(HFPATCH, "run", "--", sys.executable, str(program), str(llama_checkpoint), "spawn", site=site)
    assert wrapped.returncode == 0, wrapped.stderr
    assert wrapped.stdout.split() == ["parent", "PackMLP", "child", "PackMLP"]
    off = run(
        HFPATCH,
        "run",
        "--",
        sys.executable,
        str(program),
        str(llama_checkpoint),
        site=site,
        env={"HF_PATCH_PACKS": "none"},
    )
    assert off.stdout.split() == ["parent", "LlamaMLP"]


SERVING = """
import subprocess, sys
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1])
if sys.argv[2:] == ["spawn"]:  # a worker process, its stderr the server's
    sys.exit(subprocess.run([sys.executable, __file__, sys.argv[1]]).returncode)
"""


@pytest.mark.release_independent
def test_run_with_hf_patch_log_says_which_packs_each_load_applied(install, llama_checkpoint, tmp_path) -> None:
    """What ``hfpatch run -- transformers serve`` relies on: HF_PATCH_LOG reaches the children, each logs its plan."""
    site = install(PackSpec("mlp", MLP_PACK, version="1.2.0"))
    program = tmp_path / "serve.py"
    program.write_text(textwrap.dedent(SERVING))
    command = (HFPATCH, "run", "--", sys.executable, str(program), str(llama_checkpoint), "spawn")
    logged = run(*command, site=site, env={"HF_PATCH_LOG": "info"})
    assert logged.returncode == 0, logged.stderr
    plans = [line for line in logged.stderr.splitlines() if line.startswith("hfpatch: LlamaForCausalLM:")]
    assert len(plans) == 2, logged.stderr  # the program's load and its child's
    assert all("LlamaMLP <- PackMLP [mlp==1.2.0] (plan " in plan for plan in plans), plans
    # without HF_PATCH_LOG each process says once that packs applied, at its first patched load
    once = run(*command, site=site)
    assert once.returncode == 0, once.stderr
    said = [line for line in once.stderr.splitlines() if line.startswith("hfpatch: ")]
    assert said == plans, once.stderr
    quiet = run(*command, site=site, env={"HF_PATCH_LOG": "warning"})
    assert quiet.returncode == 0 and "hfpatch:" not in quiet.stderr, quiet.stderr
    bad = run(*command, site=site, env={"HF_PATCH_LOG": "loud"})
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == (
        "hfpatch: error: HF_PATCH_LOG='loud' is not a log level; use one of debug, info, warning, error "
        "(info logs which packs each load applied), or unset it."
    )


@pytest.mark.release_independent
def test_run_checks_the_selection_and_the_command_first(install) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    bad = run(HFPATCH, "run", "--", sys.executable, "-c", "print(1)", site=site, env={"HF_PATCH_PACKS": "nope"})
    assert bad.returncode == 2 and "names pack 'nope'" in bad.stderr and bad.stdout == ""
    missing = run(HFPATCH, "run", "--", "no-such-program-xyz", site=site)
    assert missing.returncode == 2 and "command not found: no-such-program-xyz" in missing.stderr
    empty = run(HFPATCH, "run", site=site)
    assert empty.returncode == 2 and "needs a command" in empty.stderr
    passthrough = run(HFPATCH, "run", "--", sys.executable, "-c", "import sys; sys.exit(7)", site=site)
    assert passthrough.returncode == 7
    malformed = run(
        HFPATCH, "run", "--", sys.executable, "-c", "print(1)", site=site, env={"HF_PATCH_PACKS": "all,none"}
    )
    assert malformed.returncode == 2 and "'none' cannot be combined" in malformed.stderr and malformed.stdout == ""
    strict = run(HFPATCH, "run", "--", sys.executable, "-c", "print(1)", site=site, env={"HF_PATCH_STRICT": "maybe"})
    assert (
        strict.returncode == 2 and "HF_PATCH_STRICT='maybe' is not a boolean" in strict.stderr and strict.stdout == ""
    )


@pytest.mark.release_independent
def test_run_refuses_when_the_start_up_hook_is_not_on_the_path() -> None:
    code = (
        "import os, sys; from hfpatch_core.cli.console import main; "
        "sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or '.', '_hfpatch_autorun.py'))]; "
        "sys.exit(main(['run', '--', 'true']))"
    )
    result = run(sys.executable, "-c", code)
    assert result.returncode == 2 and "start-up hook is not installed" in result.stderr


@pytest.mark.parametrize("two", [False, True])
def test_list_does_not_import_torch(install, two: bool) -> None:
    # one pack cannot conflict with another; with two, --no-conflicts reads metadata only
    site = install(PackSpec("mlp", MLP_PACK), *([PackSpec("other", mlp_pack("OtherMLP"))] if two else []))
    arguments = "['list', '--no-conflicts']" if two else "['list']"
    code = f"import sys; from hfpatch_core.cli import main; main({arguments}); print('torch' in sys.modules)"
    result = run(sys.executable, "-c", code, site=site)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
    assert "conflicts with" not in result.stdout


def test_list_marks_packs_that_conflict_and_a_selection_checked_on_every_model_type(
    install, capsys, monkeypatch
) -> None:
    from hfpatch_core.cli import main

    install(PackSpec("mlp", MLP_PACK), PackSpec("other", mlp_pack("OtherMLP")), PackSpec("norm", NORM_PATTERN_PACK))
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    # columns: pack, distribution, version, required by, status, ...
    status = {row[0]: row[4] for row in (re.split(r"\s{2,}", line) for line in out.splitlines()[2:5])}
    assert status == {
        "mlp": "enabled, conflicts with other on llama",
        "norm": "enabled",
        "other": "enabled, conflicts with mlp on llama",
    }
    assert "Conflicts: with HF_PATCH_PACKS unset, every load of these model types raises PatchConflictError:" in out
    assert "  llama: packs 'mlp' and 'other' both replace 'LlamaMLP' with priority 0" in out
    assert "HF_PATCH_PACKS=all,mlp@+1 settles every one: the resolver decided each model type two or more" in out
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settled_by"] == {"HF_PATCH_PACKS": "all,mlp@+1"} and data["conflicts_checked_on"] == ["llama"]
    assert {row["name"]: row["conflicts"] for row in data["packs"]} == {
        "mlp": [{"model_type": "llama", "target": "LlamaMLP", "with": ["other"]}],
        "norm": [],
        "other": [{"model_type": "llama", "target": "LlamaMLP", "with": ["mlp"]}],
    }
    monkeypatch.setenv("HF_PATCH_PACKS", "all,mlp@+1")
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "conflicts with" not in out and "No conflict on llama (the model types two or more enabled packs" in out


@pytest.mark.release_independent
def test_check_follows_the_selection_like_every_other_command(install) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    result = run(HFPATCH, "check", site=site, env={"HF_PATCH_PACKS": "none"})
    assert result.returncode == 0 and result.stdout == "No pack to check.\n"
    named = run(HFPATCH, "check", "mlp", site=site, env={"HF_PATCH_PACKS": "none"})
    assert named.returncode == 0 and "ok    mlp" in named.stdout  # packs named on the command line win


@pytest.mark.release_independent
def test_verify_prints_a_table_and_fails_a_bad_pack(install) -> None:
    site = install(PackSpec("mlp", MLP_PACK), PackSpec("doubling", DOUBLING_PACK))
    good = run(HFPATCH, "verify", "mlp", "--json", site=site)
    assert good.returncode == 0, good.stderr
    (row,) = json.loads(good.stdout)["rows"]
    assert (row["model_type"], row["verdict"], row["verified"]) == ("llama", "exact", "LlamaForCausalLM (llama)")
    report = row["report"]
    assert report["replaced"] == {"LlamaMLP": "PackMLP"} and report["ok"] and report["apply_path"] is True
    # transformers' progress bars (Loading weights, Writing model shards) and notices are off: progress is all
    assert good.stderr.splitlines() == ["[1/1] verifying mlp on llama ...", "[1/1] mlp on llama: exact"], good.stderr
    bad = run(HFPATCH, "verify", "doubling", "mlp", "--model-type", "llama", site=site)
    assert bad.returncode == 1
    assert "verdict" in bad.stdout and "FAILED" in bad.stdout and "exact" in bad.stdout
    assert "doubling on llama: failed: logits differ" in bad.stdout


# Patches everywhere but under hfpatch_core.apply(): a load replaces LlamaMLP, apply() replaces
# nothing, so the apply path differs from the load while the load is fine.
LOAD_ONLY_PACK = """
import inspect
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class LoadOnlyMLP(LlamaMLP):
    pass

@hookimpl
def provide_patches(context):
    applying = any(frame.filename.endswith("inplace.py") for frame in inspect.stack(0))
    if context.model_type != "llama" or applying:
        return []
    return [Patch("LlamaMLP", LoadOnlyMLP)]
"""


def test_verify_checks_the_apply_path_and_fails_a_pack_only_it_catches(install) -> None:
    site = install(PackSpec("mlp", MLP_PACK), PackSpec("load-only", LOAD_ONLY_PACK))
    result = run(HFPATCH, "verify", "mlp", "load-only", "--model-type", "llama", site=site)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    header = [cell.strip() for cell in lines[0].split("  ") if cell.strip()]
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert header[-2:] == ["apply path", "verdict"]
    assert rows["mlp"][-4:] == ["match", "ok", "ok", "exact"]
    assert rows["load-only"][-4:] == ["match", "ok", "FAILED", "FAILED"]  # only the apply path fails
    failure = "load-only on llama: failed: apply() gives other modules than the load at model.layers.0.mlp"
    assert failure in result.stdout
    assert "revert() failed" not in result.stdout  # it replaced nothing: nothing to revert


def test_verify_train_compares_training_and_fails_a_wrong_backward(install) -> None:
    site = install(PackSpec("mlp", MLP_PACK), PackSpec("detached", DETACHED_PACK))
    # the forward of "detached" is right: only training fails it (timeout: 4 models train for 5 steps)
    result = run(HFPATCH, "verify", "detached", "mlp", "--model-type", "llama", "--train", site=site, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    header, _rule, *rows = result.stdout.splitlines()[:4]
    assert header.split()[-2:] == ["training", "verdict"]
    cells = " ".join(rows[0].split())
    assert cells.startswith("detached") and cells.endswith(
        "match ok ok DIVERGES at step 1, DIVERGES at step 1 (checkpointing) FAILED"  # round trip, apply path
    )
    assert rows[1].startswith("mlp") and rows[1].split()[-5:] == ["match", "ok", "ok", "ok", "exact"]
    failure = (
        "detached on llama: failed: training (5 AdamW steps, float32, gradient checkpointing off): gradients diverge"
    )
    assert failure in result.stdout
    assert "model.layers.0.mlp.down_proj.weight (no gradient in the patched model" in result.stdout
    assert "mlp on llama:" not in result.stdout


def test_check_reports_converters_without_patches_or_model(install) -> None:
    stray = """
from hfpatch_core import Converter, hookimpl
from transformers.core_model_loading import WeightRenaming

@hookimpl
def provide_converters(context):
    if context.model_type != "llama":
        return []
    return [Converter("llama", [WeightRenaming("mlp.fc", "mlp.proj")]),
            Converter("NoSuchModelForCausalLM", [WeightRenaming("a", "b")])]
"""
    site = install(PackSpec("stray", stray))
    result = run(HFPATCH, "check", "stray", site=site)
    assert result.returncode == 1
    assert "converter for 'llama' but no patch of the pack is active for llama" in result.stdout
    assert "converter key 'NoSuchModelForCausalLM' is neither a model type nor a model class" in result.stdout


@pytest.mark.release_independent
def test_new_rejects_a_bad_name_in_one_line(tmp_path: Path) -> None:
    result = run(HFPATCH, "new", "Bad Name!", "--no-input", "-o", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hfpatch: error:") and "bad-name" in lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.release_independent
def test_output_to_a_reader_that_went_away_ends_quietly(install) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    environment = environment_with(site)
    # hfpatch list | head: the reader is gone before the first line is written
    process = subprocess.Popen(
        [HFPATCH, "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment, text=True
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    returncode = process.wait(timeout=120)
    assert process.stderr.read() == "" and returncode == 141


@pytest.mark.release_independent
def test_run_python_is_this_environments_interpreter_not_the_first_on_path(tmp_path: Path) -> None:
    # without an activated environment, the first python on PATH is another one
    other = tmp_path / "other-bin"
    other.mkdir()
    for name in ("python", "python3"):
        (other / name).write_text("#!/bin/sh\necho 'the other python'\n")
        (other / name).chmod(0o755)
    environment = {"PATH": f"{other}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    show = (
        "import os, sys; print(sys.executable, os.environ['PATH'].split(os.pathsep)[0], os.environ['HFPATCH_AUTORUN'])"
    )
    ours = os.path.dirname(sys.executable)
    for name in ("python", "python3"):
        result = run(HFPATCH, "run", "--", name, "-c", show, env=environment)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [sys.executable, ours, "1"]
    # the program's own children that start "python" get this environment's too
    child = "import subprocess; subprocess.run(['python', '-c', 'import sys; print(sys.prefix)'], check=True)"
    result = run(HFPATCH, "run", "--", "python", "-c", child, env=environment)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == sys.prefix


@pytest.mark.release_independent
def test_run_help_says_what_python_means() -> None:
    result = run(HFPATCH, "run", "--help")
    assert result.returncode == 0
    assert "'python' or 'python3' as CMD is this environment's interpreter" in " ".join(result.stdout.split())


@pytest.mark.release_independent
def test_no_command_module_imports_the_cli_package_back() -> None:
    """``hfpatch_core.cli`` dispatches to ``parser`` lazily; a command module taking a name from the
    package ``__init__`` (the exit codes once lived there) closes an import cycle."""
    import ast

    package = Path(hfpatch_core.__file__).parent / "cli"
    submodules = {path.stem for path in package.glob("*.py")}
    found = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                found += [f"{path.name}: {alias.name}" for alias in node.names if alias.name not in submodules]
            elif isinstance(node, ast.ImportFrom) and node.level == 2 and node.module == "cli":
                found.append(f"{path.name}: from ..cli import ...")
    assert not found, found


BORROWED_NORMS_PACK = """
import torch.nn as nn
from hfpatch_core import Patch, hookimpl

class AnyNorm(nn.Module):
    pass

@hookimpl
def provide_patches(context):
    # the classes a load of these types builds from modules that are not transformers.models.<type>
    return {
        "gemma3_text": [Patch("Gemma3RMSNorm", AnyNorm)],  # Gemma3ForCausalLM lives in modeling_gemma3
        "exaone": [Patch("LlamaRMSNorm", AnyNorm)],  # exaone loads as LlamaForCausalLM
        "got_ocr2": [Patch("Qwen2RMSNorm", AnyNorm)],  # built by its text model's load (qwen2)
    }.get(context.model_type, [])
"""


def test_check_resolves_classes_as_a_load_does(install, capsys, tmp_path) -> None:
    """issue 38.6: a class reached through another modeling module is a class of the model type,
    and check --record writes it."""
    from hfpatch_core.cli import main

    install(PackSpec("borrowed", BORROWED_NORMS_PACK))
    assert main(["check", "borrowed"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    known = [t for t in ("exaone", "gemma3_text", "got_ocr2") if t in CONFIG_MAPPING_NAMES]  # no exaone on 5.3
    assert out.startswith(f"ok    borrowed 1.0.0: targets {', '.join(known)}\n"), out
    assert main(["check", "--record", "borrowed"]) == 0, capsys.readouterr().out
    import hfpatch_test_pack_borrowed as pack

    from hfpatch_core.authoring.drift import record_path

    record = json.loads(record_path(pack.__file__).read_text())
    recorded = {(row["model_type"], row["class"]) for rows in record["releases"].values() for row in rows}
    borrowed = {("exaone", "LlamaRMSNorm"), ("gemma3_text", "Gemma3RMSNorm"), ("got_ocr2", "Qwen2RMSNorm")}
    assert recorded == {(t, name) for t, name in borrowed if t in known}
    from hfpatch_core._pipeline.probing import targets_of

    assert {t.class_name for t in targets_of("gemma3_text", ["Gemma3RMSNorm"])} == {"Gemma3RMSNorm"}
    assert {t.class_name for t in targets_of("got_ocr2", ["Qwen2RMSNorm"])} == {"Qwen2RMSNorm"}


@pytest.mark.release_independent
def test_progress_is_one_line_rewritten_in_place_on_a_terminal(monkeypatch) -> None:
    """``check``'s progress over hundreds of model types: one line rewritten in place on a terminal,
    plain lines (at most one every ``every`` seconds) in a log."""
    import io

    from hfpatch_core.cli.output import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream in (Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stream)
        progress = Progress("asking", 3, every=3600)
        for item in ("a", "b", "c"):
            progress.step(item)
        progress.finish()
        written = stream.getvalue()
        if isinstance(stream, Terminal):
            assert written.count("\n") == 2  # the line that starts the step, and the one that ends it
            assert written.count("\r\x1b[Khfpatch: asking: ") == 4 and written.endswith(" s\n")
            assert "\r\x1b[Khfpatch: asking: 3/3 (c)" in written
        else:
            assert "\r" not in written and len(written.splitlines()) == 2  # started, done
