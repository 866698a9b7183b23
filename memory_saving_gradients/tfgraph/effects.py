"""Whether running an op again gives the values it gave the first time.

TensorFlow's `is_stateful` flag is not enough to decide that: some ops draw
random numbers without being flagged stateful (`FractionalMaxPool`,
`FractionalAvgPool` pick new pooling regions on every run). What marks a
random op in TensorFlow's op registry is a `seed`/`seed2` attribute: every
registered op that draws from the process's random state has one, while the
stateless random ops (`StatelessRandomUniform`, ...) take their seed as an
input tensor and give the same values for the same seed. So an op reruns
identically when it is not stateful (no side effect, no hidden state) and
has no seed attribute (no random draw). `tests/test_effects.py` checks this
against every op type in the registry.
"""

import functools

from tensorflow.core.framework import op_def_pb2

from memory_saving_gradients.tfgraph import compat

SEED_ATTRS = frozenset({"seed", "seed2"})


def draws_random_numbers(op_def: op_def_pb2.OpDef) -> bool:
    """True if ops of this type may draw new random numbers on each run."""
    return any(attr.name in SEED_ATTRS for attr in op_def.attr)


def reruns_identically(op_def: op_def_pb2.OpDef) -> bool:
    """True if rerunning an op of this type on the same inputs gives the same outputs."""
    return not op_def.is_stateful and not draws_random_numbers(op_def)


@functools.lru_cache(maxsize=None)
def type_reruns_identically(op_type: str) -> bool:
    """`reruns_identically` of registered op type `op_type`, looked up once per
    type (registered OpDefs never change; reading asks it for every op). False
    for a type that is not registered: a graph function's name."""
    op_def = compat.op_def(op_type)
    return op_def is not None and reruns_identically(op_def)
