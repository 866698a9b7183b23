"""Test setup shared by every test file: environment, and the runtime fixture.

The stock-versus-ours harness lives in harness.py; shared models in models.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Allocator statistics for function_peak_bytes on any CPU (see measure.py).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")

import pytest  # noqa: E402

from harness import RUNTIMES  # noqa: E402


@pytest.fixture(params=RUNTIMES)
def runtime(request):
    """Each model test runs in a Graph + Session, in a tf.function, and under XLA."""
    return request.param
