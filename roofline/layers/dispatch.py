"""Whether the Triton kernels run: re-exported from ``roofline.kernels.switch`` (where the state lives, so that
``roofline.kernels`` imports nothing from ``roofline.layers``)."""

from roofline.kernels.switch import (  # noqa: F401
    _load_kernels,
    kernels_available,
    kernels_for,
    set_kernels_enabled,
)
