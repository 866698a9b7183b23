"""Run by test_memory.test_xla_residual_mlp_halves_activation_memory in a fresh
process: prints the stock and 'memory' activation bytes of the residual MLP
step under XLA as JSON."""

import json
import pathlib
import sys

if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).parent))  # test_memory's own imports
    import test_memory
    stock, ours = test_memory.residual_mlp_bytes(jit_compile=True)
    print(json.dumps({"stock": int(stock), "ours": int(ours)}))
