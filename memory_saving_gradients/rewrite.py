"""Rewrite: execute a Plan on a TensorFlow graph.

The only module that adds ops. It never changes an existing op: it adds
copies of each level's segment, makes them wait for the gradient that
reaches the level (so recomputation runs late, not during the forward pass),
calls the stock tf.gradients on the copies, and sums the partial gradients.
"""

import tensorflow as tf
from tensorflow.python.ops import default_gradient
from tensorflow.python.ops import gradients_impl

# Captured at import so that patching tf.gradients never makes us call ourselves.
_stock_gradients = gradients_impl.gradients


def backprop(plan, ys, xs, grad_ys, stop_gradients, tf_kwargs, unconnected):
    """Gradients of `ys` with respect to `xs` under `plan`. Returns a list."""
    graph = ys[0].graph
    checkpoints = [graph.get_tensor_by_name(n) for n in plan.checkpoints]
    checkpoint_names = set(plan.checkpoints)
    stops = list(stop_gradients)
    x_parts = [[] for _ in xs]
    ckpt_parts = {c: [] for c in plan.checkpoints}

    def collect(grads, boundary):
        for t, g in zip(boundary, grads[:len(boundary)]):
            if g is not None:
                ckpt_parts[t.name].append(g)
        for parts, g in zip(x_parts, grads[len(boundary):]):
            if g is not None:
                parts.append(g)

    # Backprop from the ys through the original ops, down to the checkpoints.
    collect(_stock_gradients(ys, checkpoints + xs, grad_ys,
                             stop_gradients=checkpoints + stops, **tf_kwargs),
            checkpoints)

    seeds = {}
    for number, level in reversed(list(enumerate(plan.levels))):
        for c in level.checkpoints:
            if ckpt_parts[c]:
                seeds[c] = tf.convert_to_tensor(_sum(ckpt_parts[c]))
        roots = [c for c in level.checkpoints if c in seeds]
        if not roots:
            continue
        with graph.name_scope(f"recompute_{number}"):
            copies = _copy_segment(graph, level, seeds)
        boundary = [copies[c] if c in copies else graph.get_tensor_by_name(c) for c in roots]
        read = _checkpoints_read(graph, level, roots, copies, checkpoint_names)
        collect(_stock_gradients(
            boundary, read + xs, [seeds[c] for c in roots],
            stop_gradients=read + [copies.get(s.name, s) for s in stops], **tf_kwargs),
            read)

    results = []
    for x, parts in zip(xs, x_parts):
        # An x inside the region is a checkpoint; its seed is its full gradient.
        grad = seeds.get(x.name) if x.name in checkpoint_names else _sum(parts)
        if grad is None and unconnected == tf.UnconnectedGradients.ZERO:
            grad = default_gradient.zeros_like(x)
        results.append(grad)
    return results


def _copy_segment(graph, level, seeds):
    """Copies the level's ops; returns original tensor name -> copied tensor.

    Ops that read no other copy get control inputs on the gradients of the
    checkpoints they serve, so the executor cannot run them early.
    """
    copies = {}
    for op_name in level.copy_ops:
        owners = [seeds[c] for c in level.owners[op_name] if c in seeds]
        if not owners:
            continue  # serves only checkpoints that receive no gradient
        op = graph.get_operation_by_name(op_name)
        inputs = [copies.get(i.name, i) for i in op.inputs]
        waits = [] if any(i.name in copies for i in op.inputs) else [g.op for g in owners]
        with graph.control_dependencies(waits):
            new = graph._create_op_internal(  # pylint: disable=protected-access
                op.type, inputs, dtypes=[o.dtype for o in op.outputs],
                name=op.name, attrs=dict(op.node_def.attr),
                op_def=op.op_def, compute_device=False)
        new._set_device(op.device)  # pylint: disable=protected-access
        for old_t, new_t in zip(op.outputs, new.outputs):
            new_t.set_shape(old_t.shape)
            copies[old_t.name] = new_t
    return copies


def _checkpoints_read(graph, level, roots, copies, checkpoint_names):
    """Checkpoints the level's recomputation reads: where its backprop stops."""
    readers = [graph.get_operation_by_name(op) for op in level.copy_ops]
    readers += [graph.get_tensor_by_name(c).op for c in roots if c not in copies]
    read = {}
    for op in readers:
        for i in op.inputs:
            if i.name in checkpoint_names and i.name not in copies:
                read[i.name] = i
    return list(read.values())


def _sum(parts):
    """Sums partial gradients; IndexedSlices stay sparse when all parts are."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, tf.IndexedSlices) for p in parts):
        index_dtype = tf.int64 if any(p.indices.dtype == tf.int64 for p in parts) else tf.int32
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], axis=0),
            tf.concat([tf.cast(p.indices, index_dtype) for p in parts], axis=0),
            parts[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(p) for p in parts])
