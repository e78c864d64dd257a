"""Old import path of `runtime.mesh` (and of the mesh helpers now in `models.sharding`)."""

from sfi_jax.runtime.mesh import *  # noqa: F403
from sfi_jax.runtime.mesh import __all__  # noqa: F401
