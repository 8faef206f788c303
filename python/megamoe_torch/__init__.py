"""megamoe_torch: run a layer exported by ``megamoe export`` from PyTorch.

    from megamoe_torch import MegaMoE
    moe = MegaMoE.from_export("export/flash", w13, w13_scale, w2, w2_scale)
    out = moe.forward(x, topk_ids, topk_weights)

torch is imported only when a layer is built: the manifest reader, the argument packing and the checks
import (and are tested) without it.
"""

from .errors import CudaError, ManifestError, MegaMoEStatusError
from .layer import MegaMoE, clear_cache, fused_experts
from .manifest import Manifest, load_manifest

__version__ = "0.1.0"

__all__ = [
    "MegaMoE",
    "fused_experts",
    "clear_cache",
    "load_manifest",
    "Manifest",
    "ManifestError",
    "CudaError",
    "MegaMoEStatusError",
    "__version__",
]
