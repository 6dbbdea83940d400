"""Example packs shipped with hfpatch-core, used by ``hfpatch demo``."""
