"""veloxquant: compressed key/value caches for MLX.

The native module shares one MLX runtime with ``mlx.core``: mlx is imported
first, and a different installed mlx version is refused with an ImportError
that says which version to install. On Linux with the ``mlx[cpu]`` wheel,
importing veloxquant before mlx makes MLX's CPU matmul use OpenBLAS when the
system has it (``veloxquant.blas``).
"""

from importlib import metadata as _metadata

MLX_REQUIRED = "0.32.4"


def _check_mlx() -> None:
    try:
        found = _metadata.version("mlx")
    except _metadata.PackageNotFoundError:
        found = None
    if found != MLX_REQUIRED:
        raise ImportError(
            f"veloxquant needs mlx=={MLX_REQUIRED}, but "
            + (f"mlx {found} is installed" if found else "mlx is not installed")
            + f": pip install 'mlx[cpu]=={MLX_REQUIRED}' (Linux CPU), "
            f"'mlx[cuda13]=={MLX_REQUIRED}' (NVIDIA) or 'mlx=={MLX_REQUIRED}' (macOS)"
        )


_check_mlx()

from . import blas  # noqa: E402

# OpenBLAS in place of the reference BLAS of the mlx[cpu] wheel, before libmlx
# loads (veloxquant.blas says when; VELOXQUANT_BLAS=reference opts out).
blas.enable()

import mlx.core  # noqa: E402  (must load libmlx before the native module)

from . import _native  # noqa: E402
from . import kernels  # noqa: E402
from ._native import LayerCache  # noqa: E402
from . import quant  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LayerCache", "kernels", "quant", "MLX_REQUIRED", "__version__"]
