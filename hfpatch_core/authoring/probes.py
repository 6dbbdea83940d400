"""What a pack may ask about the installed transformers.

hfpatch supports a range of transformers releases; a pack that must behave differently
across them asks here (the feature, never the version), so that its probes and core's
agree.  Every function is cached or cheap: call it at load time.
"""

from __future__ import annotations

from .._compat import class_keys_supported, parallel_modes

__all__ = ["class_keys_supported", "parallel_modes"]
