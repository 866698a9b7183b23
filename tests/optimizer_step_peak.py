"""The optimizer guard's step measured: run by tests/test_stock_fallback.py.

    TF_CPU_ALLOCATOR_USE_BFC=1 TF_NUM_INTEROP_THREADS=1 python -m tests.optimizer_step_peak

benchmarks/optimizer_guard.py's step at 128 rows x 512 units, tf.gradients'
and the plan the stock fallback refuses ("memory" with the fallback off):
prints each one's allocator peaks and whether the plan was stock's, as JSON.
"""

from benchmarks import optimizer_guard

if __name__ == "__main__":
    optimizer_guard.print_peaks(128, 512, ("tf.gradients", "memory, fallback off"))
