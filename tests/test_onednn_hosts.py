"""With oneDNN's kernels (TensorFlow's default on CPUs with AVX-512 VNNI or AMX),
convolution gradients take no scratch from TensorFlow's allocator: the rewrite
must then keep the stock gradients (ours would only add buffers) and still save.

The rest of the suite runs TensorFlow's own kernels (conftest.py), so this runs
tests/onednn_cnn_step.py and tests/onednn_unet_step.py in fresh processes with
oneDNN on.
"""

import json
import os
import pathlib
import subprocess
import sys


def _run(module: str) -> str:
    """The standard output of `python -m module`, oneDNN on, in a fresh process."""
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", module],
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1",
                                   TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(root)),
                          cwd=root, check=True, capture_output=True, text=True, timeout=600)
    return done.stdout


def test_a_cnn_step_with_onednn_kernels():
    row = json.loads(_run("tests.onednn_cnn_step").splitlines()[-1])
    assert row["error"] < 1e-5, row
    if not row["kernels_take_scratch"]:
        assert row["scratch_free_convolutions"] == 0, row
    # Measured: 6.2 against 15.1 MB with oneDNN's kernels, 8.0 against 64.3 MB with TF's.
    assert row["ours_peak"] < 0.75 * row["stock_peak"], row


def test_stock_convolution_gradients_of_a_unet_with_onednn_kernels():
    # Images of unknown size: every convolution keeps its stock gradient.
    # Failed before with "6 nodes in a cycle" in both modes.
    rows = [json.loads(line) for line in _run("tests.onednn_unet_step").splitlines()[-2:]]
    assert [row["mode"] for row in rows] == ["speed", "memory"]
    for row in rows:
        assert "failed" not in row, row
        assert row["error"] < 1e-5, row
