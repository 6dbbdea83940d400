"""Real test distributions: a dist-info directory and a module on a temporary path."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """One pack distribution to write: entry point ``name`` -> module ``module``."""

    name: str
    source: str
    module: str = ""
    distribution: str = ""
    version: str = "1.0.0"
    summary: str = "A test pack"
    requires: tuple[str, ...] = ("transformers>=5.3,<6",)
    entry_value: str = ""

    @property
    def module_name(self) -> str:
        return self.module or "hfpatch_test_pack_" + self.name.replace("-", "_").replace(".", "_")

    @property
    def distribution_name(self) -> str:
        return self.distribution or f"hfpatch-pack-{self.name}"


def write_pack(site: Path, spec: PackSpec) -> Path:
    """Install ``spec`` into ``site`` as a distribution that importlib.metadata finds."""
    site.mkdir(parents=True, exist_ok=True)
    module_file = site / f"{spec.module_name}.py"
    if not module_file.exists():
        module_file.write_text(textwrap.dedent(spec.source))
    dist_dir = site / f"{spec.distribution_name.replace('-', '_')}-{spec.version}.dist-info"
    dist_dir.mkdir()
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {spec.distribution_name}",
        f"Version: {spec.version}",
        f"Summary: {spec.summary}",
        "Requires-Dist: hfpatch-core",
        *(f"Requires-Dist: {requirement}" for requirement in spec.requires),
    ]
    (dist_dir / "METADATA").write_text("\n".join(metadata) + "\n")
    (dist_dir / "entry_points.txt").write_text(
        f"[hfpatch.packs]\n{spec.name} = {spec.entry_value or spec.module_name}\n"
    )
    (dist_dir / "RECORD").write_text("")
    return dist_dir


def install_packs(site: Path, specs: Iterable[PackSpec]) -> Path:
    for spec in specs:
        write_pack(site, spec)
    importlib.invalidate_caches()
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return site


MLP_PACK = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaMLP

    class PackMLP(LlamaMLP):
        pass

    @hookimpl
    def provide_patches(context):
        if context.model_type == "llama":
            return [Patch("LlamaMLP", PackMLP)]
        return []
"""

NORM_PATTERN_PACK = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class PackNorm(LlamaRMSNorm):
        pass

    @hookimpl
    def provide_patches(context):
        if context.model_type == "llama":
            return [Patch(".*RMSNorm$", PackNorm)]
        return []
"""


def mlp_pack(
    class_name: str = "PackMLP",
    *,
    target: str = "LlamaMLP",
    priority: int = 0,
    overwrite: bool = False,
    init_raises: bool = False,
) -> str:
    """Source of a pack replacing ``target`` with a LlamaMLP subclass called ``class_name``."""
    body = "raise RuntimeError('replacement init failed')" if init_raises else "super().__init__(*args, **kwargs)"
    return f"""
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class {class_name}(LlamaMLP):
    def __init__(self, *args, **kwargs):
        {body}

@hookimpl
def provide_patches(context):
    if context.model_type == "llama":
        return [Patch({target!r}, {class_name}, priority={priority}, overwrite={overwrite})]
    return []
"""
