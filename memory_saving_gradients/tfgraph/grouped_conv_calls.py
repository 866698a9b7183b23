"""Gradients of Keras's XLA-compiled depthwise convolutions without XLA's dense filter gradient.

Keras 3 runs a grouped `Conv2D` (`groups > 1`, e.g. ConvNeXt's 7x7
depthwise convolutions) in a function compiled by XLA (`_XlaMustCompile`), as
TensorFlow's CPU kernels refuse grouped convolutions. When each input
channel has one output channel (a plain depthwise convolution), XLA's CPU
backend computes that function's filter gradient as a dense convolution over
every (input, output) channel pair, masks the pairs outside a group and sums
the taps: its compiled backward holds one preallocated temporary of two
K x K x C x C arrays. For 7x7 and 768 channels that is 231,211,008 bytes
(XLA's buffer assignment: f32[768,7,7,768] + f32[7,7,768,768]), allocated
outside any op's annotation and taken whatever the batch or image size;
ConvNeXtTiny at 64 px, batch 8 holds it at the peak of a stock step (3x the
activations).

When each group has one input channel (a depthwise convolution, the common
case), TensorFlow's native depthwise gradient kernels give the same
gradients with per-pixel scratch only. `native_gradients(ops)` makes
tf.gradients use them for such call ops among `ops` while it is open, on
CPU-only hosts (the backend measured), when the call's body is a
single NHWC, unit-dilation, equal-stride `Conv2D` reached from the call's inputs (the
filter directly or through one variable read) and nothing may assign that
variable between the forward pass and backprop (the filter is read again there).
Not inside a step compiled by XLA (jit_compile): XLA compiles the native
kernels with the same dense temporary (measured 32.0 MiB for 7x7, 256
channels, as stock), so such calls keep the stock gradient.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import graph_cache
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import purity
from memory_saving_gradients.tfgraph import writers

NATIVE_DEPTHWISE_GRADIENT = "MemorySavingGradientsNativeDepthwiseCall"
_CALL_TYPES = ("PartitionedCall", "StatefulPartitionedCall")
_BODY_TYPES = frozenset({"Conv2D", "ReadVariableOp", "Identity", "NoOp"})


@contextlib.contextmanager
def native_gradients(ops: Iterable[tf.Operation]) -> Iterator[None]:
    """Within, tf.gradients differentiates the eligible calls among `ops`
    (and copies made meanwhile) with native depthwise gradient kernels."""
    with compat.gradients_overridden([op for op in ops if is_eligible(op)],
                                     NATIVE_DEPTHWISE_GRADIENT):
        yield


def is_eligible(op: tf.Operation) -> bool:
    """True for an XLA-compiled call of one depthwise-form grouped convolution
    (see the module docstring) whose gradient may be taken natively."""
    # Under XLA the native kernels compile densely too.
    if _depthwise_filter_shape(op) is None or not op_kinds.gradient_overridable_on_cpu(op):
        return False
    strides = _attr(_convolution(op)["node"], "strides").list.i
    if strides[1] != strides[2]:  # the native depthwise kernels refuse unequal ones
        return False
    w = op.inputs[_convolution(op)["inputs"][1]]
    if w.dtype != tf.resource:
        return True
    found = graph_cache.per_graph(op.graph, writers.VariableWriters)
    return not loops.assigned_meanwhile(op, found)


def stock_workspace_bytes(op: tf.Operation) -> int:
    """XLA's temporary in the stock gradient of a depthwise convolution call
    with one output channel per input channel on CPU: two K x K x C x C arrays
    (its buffer assignment, 7x7: f32[C,7,7,C] and f32[7,7,C,C] at C = 64 and
    768). With more output channels per input XLA takes per-pixel ones (measured
    0.1 MiB at C = 64, M = 128): 0 then, and for other ops."""
    shape = _depthwise_filter_shape(op)
    if shape is None or tf.config.list_logical_devices("GPU"):
        return 0
    kh, kw, _, outputs = shape.as_list()
    if outputs != op.inputs[_convolution(op)["inputs"][0]].shape[-1]:
        return 0
    return 2 * kh * kw * outputs * outputs * op.outputs[0].dtype.size


def _depthwise_filter_shape(op: tf.Operation):
    """The filter shape [K, K, 1, M] of the convolution call `op` is when it is
    one of depthwise form (C image channels, M a multiple of C), else None."""
    if op.type not in _CALL_TYPES or len(op.outputs) != 1:
        return None
    conv = _convolution(op)
    if conv is None:
        return None
    image, w = (op.inputs[i] for i in conv["inputs"])
    shape = _filter_shape(w)
    if shape is None or shape.rank != 4 or not shape.is_fully_defined():
        return None
    channels = image.shape[-1]
    if not (channels and channels > 1 and shape[2] == 1 and shape[3] % channels == 0):
        return None
    return shape


def _convolution(op: tf.Operation):
    """{"node": the body's Conv2D NodeDef, "inputs": (image, filter) call input
    indices} when `op` calls an XLA-compiled function that is just that
    convolution (NHWC, unit dilations) of two of its arguments; else None."""
    function = purity.find_function(op.graph, op.get_attr("f").name)
    definition = None if function is None else function.cached_definition
    if definition is None or not _attr(definition, "_XlaMustCompile").b:
        return None
    nodes = {n.name: n for n in definition.node_def}
    convs = [n for n in nodes.values() if n.op == "Conv2D"]
    if len(convs) != 1 or any(n.op not in _BODY_TYPES for n in nodes.values()):
        return None
    conv = convs[0]
    if (_attr(conv, "data_format").s not in (b"", b"NHWC")  # b"": the default, NHWC
            or list(_attr(conv, "dilations").list.i) not in ([], [1] * 4)
            or _source(nodes, next(iter(definition.ret.values()))) is not conv):
        return None
    args = [a.name for a in definition.signature.input_arg]
    image, w = conv.input[0], conv.input[1].split(":")[0]
    if w in nodes and nodes[w].op == "ReadVariableOp":
        w = nodes[w].input[0]
    if image not in args or w not in args:
        return None
    return {"node": conv, "inputs": (args.index(image), args.index(w))}


def _attr(message, name: str):
    """`message.attr[name]` (a FunctionDef's or NodeDef's), or an empty AttrValue.

    Never `message.attr[name]` for a missing name: a protobuf map inserts it,
    and these messages are TensorFlow's own cached function definitions: an
    empty attr there fails the call at run time ("Failed to bind all
    placeholders in <Unknown AttrValue type>").
    """
    return message.attr[name] if name in message.attr else compat.empty_attr_value()


def _filter_shape(w: tf.Tensor):
    """The static shape of filter `w`, or of the variable behind handle `w` (None: unknown)."""
    return compat.resource_shape(w) if w.dtype == tf.resource else w.shape


def _source(nodes, tensor_name: str):
    """The NodeDef making `tensor_name` (a function's output), through Identity ops."""
    node = nodes.get(tensor_name.split(":")[0])
    while node is not None and node.op == "Identity":
        node = nodes.get(node.input[0].split(":")[0])
    return node


@tf.RegisterGradient(NATIVE_DEPTHWISE_GRADIENT)
def _native_depthwise_gradient(op, grad):
    conv = _convolution(op)
    node, (image_index, w_index) = conv["node"], conv["inputs"]
    image, w = op.inputs[image_index], op.inputs[w_index]
    kh, kw, _, outputs = _filter_shape(w).as_list()
    # Forward tensors are read when the gradient arrives, not in the forward pass.
    with tf.control_dependencies([grad]):
        if w.dtype == tf.resource:
            w = tf.raw_ops.ReadVariableOp(resource=w, dtype=grad.dtype)
        channels = image.shape[-1]
        depthwise = [kh, kw, channels, outputs // channels]  # output c*m+j: input c, column j
        attrs = {"strides": list(_attr(node, "strides").list.i),
                 "padding": _attr(node, "padding").s.decode(),
                 "explicit_paddings": list(_attr(node, "explicit_paddings").list.i)}
        d_image = tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
            input_sizes=tf.shape(image), filter=tf.reshape(w, depthwise),
            out_backprop=grad, **attrs)
        d_w = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=image, filter_sizes=depthwise, out_backprop=grad, **attrs)
    grads = [None] * len(op.inputs)
    grads[image_index], grads[w_index] = d_image, tf.reshape(d_w, [kh, kw, 1, outputs])
    return grads
