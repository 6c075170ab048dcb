"""Skip markers for tests of the native CPU kernels, naming what this host lacks (ARM, macOS, no compiler)."""

import pytest

from ascq.kernels import native

needs_native = pytest.mark.skipif(
    native.load() is None, reason=f"no native CPU kernels here: {native.unavailable_reason()}"
)


def skip_without_native() -> None:
    if native.load() is None:
        pytest.skip(f"no native CPU kernels here: {native.unavailable_reason()}")
