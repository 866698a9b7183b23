"""Side inputs a level makes again instead of keeping them from the forward pass.

A copied op may read a tensor that depends on neither the data nor the
weights, so it lies outside the region the planner models: a dropout mask
(a stateless random draw from a small seed compared with the rate), a
broadcast constant. Read as it is, the copy keeps that tensor alive from the
forward pass to the copy's level; with dropout in every block of a
transformer, those masks are a fifth of the memory at the peak. When the
tensor is made by ops that rerun identically (`op_kinds.is_recomputable`)
from tensors smaller than it, the level makes it again once its gate opens,
reading those smaller tensors (the same seed, so the same mask), and the
forward pass's tensor is freed after its last forward reader. (With a batch size unknown
when the graph is built, a mask's shape is read from the data, which makes it an
activation that levels recompute like any other; this is for static shapes.)
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import op_kinds


class SideInputs:
    """Which side inputs can be made again, and making them once per level.

    `outside(name)`: True for tensors outside the region and the boundary
    (neither activations, checkpoints, weights nor xs): the only ones made again.
    """

    def __init__(self, outside):
        self._outside = outside
        self._memo = {}  # tensor name -> regenerable?
        self._from_ref = {}  # tensor name -> computed from a ref variable?

    def regenerable(self, tensor: tf.Tensor) -> bool:
        """True if `tensor` can be made again from smaller tensors by rerunning pure ops.

        Example: GreaterEqual(StatelessRandomUniformV2(shape, key, counter), rate)
        is regenerable: the uniform draw is larger than the mask, but is itself
        made from the shape, key and counter, all smaller than the mask.
        """
        name = tensor.name
        if name not in self._memo:
            self._memo[name] = False  # a cycle (never in a graph) cannot recurse
            self._memo[name] = self._judge(tensor)
        return self._memo[name]

    def _judge(self, tensor):
        op = tensor.op
        # An op without inputs (constants, placeholders: the data) is not remade.
        if (not self._outside(tensor.name) or not op.inputs or op.control_inputs
                or op.type in op_kinds.DATA_SOURCE_OP_TYPES
                or not tensor.shape.is_fully_defined() or not op_kinds.is_recomputable(op)):
            return False
        size = op_kinds.tensor_bytes(tensor)
        return all(self._read_as_is(i, size) or self.regenerable(i) for i in op.inputs)

    def made_again(self, tensor: tf.Tensor, made: dict, gate) -> tf.Tensor:
        """`tensor` made again for one level (`made`: that level's, by name), or None.

        Ops reading no tensor made again wait for `gate`, the level's start, so
        the executor does not run them early, nor grappler merge them with the
        originals. Without a gate (tf.compat.v1 control flow) nothing is made.
        """
        if gate is None or not self.regenerable(tensor):
            return None
        if tensor.name not in made:
            op = tensor.op
            size = op_kinds.tensor_bytes(tensor)
            inputs = [i if self._read_as_is(i, size) else self.made_again(i, made, gate)
                      for i in op.inputs]
            waits = [] if any(new is not old for new, old in zip(inputs, op.inputs)) else [gate.op]
            with tensor.graph.control_dependencies(waits):
                new = compat.create_op_copy(tensor.graph, op, inputs, keep_shapes=True)
            compat.set_device(new, op.device)
            made.update((old.name, out) for old, out in zip(op.outputs, new.outputs))
        return made[tensor.name]

    def _read_as_is(self, tensor: tf.Tensor, size: int) -> bool:
        """True if a tensor made again reads `tensor` itself: a constant (alive anyway), or
        smaller than the `size` bytes made again (keeping it costs less) and not computed
        from a ref variable."""
        return tensor.op.type == "Const" or (tensor.shape.is_fully_defined()
                                             and op_kinds.tensor_bytes(tensor) < size
                                             and not self._from_a_ref_variable(tensor))

    def _from_a_ref_variable(self, tensor: tf.Tensor) -> bool:
        """True if `tensor` is computed from a tf.compat.v1 ref variable. Its read is the
        variable's buffer, which an assignment in the step changes in place, and many
        kernels hand on their input's buffer rather than a copy, some only for some shapes
        (Identity, Reshape, Bitcast, EnsureShape, CheckNumerics, a slice of whole rows, a
        transpose by the identity, a zero pad): read later by a level, such a tensor may no
        longer hold what the forward pass read. Walks back; a walk stops at tensors earlier
        walks found free of ref variables. A walk that finds none found every tensor it
        visited free too (all their ancestors were visited): each is remembered, so
        walks over shared ancestors take linear time in all."""
        if tensor.name not in self._from_ref:
            todo, seen, found = [tensor], set(), False
            while todo and not found:
                t = todo.pop()
                if t.name in seen or self._from_ref.get(t.name) is False:
                    continue
                seen.add(t.name)
                found = self._from_ref.get(t.name) or compat.is_ref_dtype(t.dtype)
                todo.extend(t.op.inputs)
            if not found:
                self._from_ref.update(dict.fromkeys(seen, False))
            self._from_ref[tensor.name] = found
        return self._from_ref[tensor.name]
