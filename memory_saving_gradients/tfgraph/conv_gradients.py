"""Convolution gradients without the CPU kernels' scratch buffers.

On CPU, TensorFlow's `Conv2DBackpropFilter` kernel takes a scratch buffer of
up to 32 MiB (its im2col working set) whatever the tensors' size, and for a
1x1 convolution so does `Conv2DBackpropInput` (measured at batch 8: 32 MiB
beside tensors of 0.4-3 MiB). On small inputs that buffer, not the
activations, sets the step's peak (MobileNetV2 at 64 px: 32 of tf.gradients'
56 MiB; ResNet50 22 of 47), so no choice of checkpoints can go below it.

Both gradients are matrix products over the pixels instead, for any
stride and kernel size (SAME or VALID, unit dilations): the filter's
gradient at tap (a, b) is the image pixels that tap reads (a strided slice)
times the output gradient, one `MatMul` per tap, run one after the other so
one slice is alive at a time (over parts of the batch where a tap's slices
of the whole batch would pass TAP_SLICE_BYTES; a batch unknown when traced
is split into as many parts as 32 images need, each sized at run time). The
input gradient is the
output gradient spread onto the image's grid (stride - 1 zeros between pixels), correlated
with the filter flipped in space: a forward `Conv2D` (its kernel takes little
scratch: measured under 1 MiB where `Conv2DBackpropInput` took 32 MiB); for a
1x1 filter a `MatMul`, then the spreading. A transposed convolution (a
forward `Conv2DBackpropInput`) is the input gradient of the convolution it
transposes: its own gradients are that convolution (forward `Conv2D`) and
the same per-tap filter gradient. Measured at batch 8: ResNet50's 7x7
stride-2 stem's stock gradient peaks at 33.5 MiB, ours 7.2 (mostly the
spread output gradient); a U-Net's 2x2 stride-2 up-sampling's 32.5 MiB,
ours 0.8.

`scratch_free_gradients(ops)` makes tf.gradients use these for the eligible
convolutions among `ops` while it is open; copies made meanwhile (the
rewrite's recomputation) keep them, as a copy takes its original's
attributes. Only on CPU-only hosts: GPU kernels have no such scratch. Not
under XLA (jit_compile), which compiles convolutions itself without that
scratch: there the per-tap products only added buffers (the classic U-Net's
`"memory"` step measured 128 MiB against tf.gradients' 64; 64 without them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Iterator

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import gradient_linearity
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import sized_shapes

SCRATCH_FREE_GRADIENT = "MemorySavingGradientsScratchFreeConv"
# Most bytes one filter tap's slices take at once: past it the filter gradient
# slices parts of the batch, summing each tap's products over them (VGG16's
# first block at 64 px, batch 8: 16 MiB a tap, its plans' peak; 4 in 4 parts).
TAP_SLICE_BYTES = 4 * 2**20


def is_eligible(op: tf.Operation) -> bool:
    """True for a CPU `Conv2D` or transposed convolution (`Conv2DBackpropInput`)
    in NHWC, SAME or VALID, any strides, unit dilations, static filter and
    spatial shapes, not grouped, without a gradient override of its own."""
    if op.type not in _KINDS or not op_kinds.gradient_overridable_on_cpu(op):
        return False
    image, w, out = roles(op)
    if not (w.shape.is_fully_defined() and image.shape[1:].is_fully_defined()
            and out.shape[1:].is_fully_defined()
            and op.get_attr("data_format") == b"NHWC"
            and op.get_attr("padding") in (b"SAME", b"VALID")
            and list(op.get_attr("dilations")) == [1, 1, 1, 1]
            and _strides(op)[0] == _strides(op)[3] == 1):
        return False
    axes = _axes(op)
    return (image.shape[-1] == w.shape[2] and out.shape[-1] == w.shape[3]  # grouped: fewer
            and [axis.out for axis in axes] == out.shape[1:3].as_list())


def is_pointwise(op: tf.Operation) -> bool:
    """An eligible unit-stride 1x1 convolution (its gradient slices nothing)."""
    return (is_eligible(op) and op.type == "Conv2D" and op.inputs[1].shape[:2] == [1, 1]
            and _strides(op) == [1, 1, 1, 1])


def workspace_bytes(op: tf.Operation, input_gradient: bool = True,
                    filter_gradient: bool = True) -> int:
    """Scratch of our gradient of eligible `op` besides its results: unless
    `filter_gradient` is False (the filter is not differentiated: a frozen
    layer's) the filter gradient's tap slices of the image and of the output
    gradient and its per-tap products (a filter's bytes, until stacked), and
    unless `input_gradient` is False (the image is not differentiated) the
    input gradient's product and spread output gradient, and a spatial
    filter's flipped copy (`ReverseV2`, then `Transpose`: two filters' bytes
    alive at once; ResNet50's 3x3 512 -> 512 ones 18 MiB, the largest buffers
    at its plans' activation peaks, docs/planner.md). TensorFlow prunes the
    part not differentiated."""
    if is_pointwise(op):
        return 0
    _, w, out = roles(op)
    kh, kw, channels_in, _ = w.shape.as_list()
    stride_h, stride_w = _strides(op)[1:3]
    out_bytes = op_kinds.tensor_bytes(out)
    per_channel_in = out_bytes // out.shape[-1] * channels_in
    taps, parts = (_filter_gradient_scratch(op, w, out, per_channel_in) if filter_gradient
                   else (0, 0))
    if op.type == "Conv2DBackpropInput" or not input_gradient:
        return taps + parts  # a transposed one's input gradient is a forward Conv2D
    spread = stride_h * stride_w * (per_channel_in if (kh, kw) == (1, 1) else out_bytes)
    product = per_channel_in if (kh, kw) == (1, 1) else 0
    # The flipped filter is made, read and freed by the input gradient, the parts by
    # the filter gradient: one op at a time (the timeline's order), not both at once
    # (with several threads they met: ResNet50's plans measured 9 MiB higher).
    flipped = 0 if (kh, kw) == (1, 1) else 2 * op_kinds.tensor_bytes(w)
    return taps + (0 if spread == out_bytes else 2 * spread) + product + max(parts, flipped)


def _filter_gradient_scratch(op, w, out, per_channel_in):
    """(tap slices, per-tap products) of our filter gradient of `op`: one tap's
    two slices, whatever the stride, for the largest part of the batch; the
    products, a filter's bytes in all, alive until they are stacked into the
    filter gradient, and the last tap's, one per part, until summed."""
    kh, kw = w.shape.as_list()[:2]
    parts = _batch_parts(op)
    taps = per_channel_in + op_kinds.tensor_bytes(out)  # _tap_slice_bytes: whole batch
    if parts > 1:  # (an empty batch is never split)
        batch = _planned_batch(op)
        taps = taps // batch * _part_size(batch, parts)
    return taps, op_kinds.tensor_bytes(w) * (kh * kw + parts - 1) // (kh * kw)


def _tap_slice_bytes(op: tf.Operation) -> int:
    """Bytes of one filter tap's two slices over the whole batch: the image
    pixels it reads, the output gradient's pixels they pair with."""
    _, _, out = roles(op)
    out_bytes = op_kinds.tensor_bytes(out)
    return out_bytes // out.shape[-1] * op.inputs[1].shape[2] + out_bytes


def _planned_batch(op: tf.Operation) -> int:
    """The batch size of `op`'s output as planned: an unknown one as
    `sized_shapes` assumes it."""
    return sized_shapes.sized_dims(roles(op)[2])[0]


def _batch_parts(op: tf.Operation) -> int:
    """How many parts of the batch the filter gradient takes its tap slices
    over, so that one tap's two slices of a part stay within TAP_SLICE_BYTES
    at the planned batch; 1 (the whole batch at once) if they fit, or for a
    pointwise convolution (its slices are the tensors themselves)."""
    whole_batch = _tap_slice_bytes(op)
    if is_pointwise(op) or whole_batch <= TAP_SLICE_BYTES:
        return 1
    batch = _planned_batch(op)
    images = max(TAP_SLICE_BYTES // (whole_batch // batch), 1)
    return -(-batch // images)


def _part_size(batch, parts: int):
    """Images in each of `parts` parts covering `batch` (an int or a scalar
    tensor): the last may be smaller, or empty."""
    return (batch + parts - 1) // parts


def _batch_slices(image: tf.Tensor, parts: int) -> list:
    """`parts` slices of the batch of `image` that cover it, whatever its size
    at run time where it is unknown when traced."""
    if parts == 1:
        return [slice(None)]
    batch = image.shape[0] if image.shape[0] is not None else tf.shape(image)[0]
    size = _part_size(batch, parts)
    return [slice(part * size, (part + 1) * size) for part in range(parts)]


@contextlib.contextmanager
def scratch_free_gradients(ops: Iterable[tf.Operation]) -> Iterator[None]:
    """Within, tf.gradients differentiates the eligible convolutions among
    `ops` (and copies of them made meanwhile) with matrix products.

    The attribute selecting that gradient is on the originals only while the
    context is open, so other gradient calls on the graph see them unchanged.
    """
    with compat.gradients_overridden([op for op in ops if is_eligible(op)],
                                     SCRATCH_FREE_GRADIENT):
        yield


def scratch_free_transposed_copy(op: tf.Operation, inputs) -> tf.Tensor:
    """Transposed convolution `op` on `inputs` (its three inputs' stand-ins)
    without the CPU kernel's scratch, differentiated as under `scratch_free_gradients`.

    Where each image pixel takes at most one filter tap (kernel <= stride, as
    a U-Net's 2x2 stride-2 up-sampling) one `MatMul` gives every tap's pixels,
    rearranged onto the grid: the stock FLOPs. Else the input-gradient form
    (spread, then a forward `Conv2D`): stride^2 the FLOPs. The ops wait for
    `op`'s output-size input too, as a stock copy would.
    """
    input_sizes, w, out_backprop = inputs
    axes = _axes(op)

    @tf.custom_gradient
    def transposed(out_backprop, w):
        def gradient(grad):
            return _transposed_gradients(op, w, out_backprop, grad)
        if taps_apart(op):
            return _tiled(axes, w, out_backprop), gradient
        return _input_gradient(axes, w, out_backprop), gradient

    with tf.control_dependencies([input_sizes]):
        result = transposed(out_backprop, w)
    gradient_linearity.declare_linear([result])  # a convolution's: linear in `grad`
    return result


def taps_apart(op: tf.Operation) -> bool:
    """True when each image pixel of eligible convolution `op` takes at most
    one filter tap (kernel <= stride on both axes)."""
    return all(axis.kernel <= axis.stride for axis in _axes(op))


def _tiled(axes, w, out_backprop):
    """Transposed convolution with kernel <= stride: image pixel p + before of
    the grid (out * stride per axis) is one output pixel times one tap."""
    kh, kw, channels_in, channels_out = w.shape.as_list()
    product = tf.matmul(tf.reshape(out_backprop, [-1, channels_out]),
                        tf.reshape(w, [kh * kw * channels_in, channels_out]), transpose_b=True)
    taps = tf.reshape(product, [-1, axes[0].out, axes[1].out, kh, kw, channels_in])
    gaps = [axes[0].stride - kh, axes[1].stride - kw]
    if any(gaps):  # grid pixels no tap reaches
        taps = tf.pad(taps, [[0, 0]] * 3 + [[0, gaps[0]], [0, gaps[1]], [0, 0]])
    grid = tf.reshape(tf.transpose(taps, [0, 1, 3, 2, 4, 5]),
                      [-1, axes[0].out * axes[0].stride, axes[1].out * axes[1].stride,
                       channels_in])
    ends = [min(axis.before + axis.length, axis.out * axis.stride) for axis in axes]
    if any(axis.before for axis in axes) or ends != grid.shape[1:3].as_list():
        grid = grid[:, axes[0].before:ends[0], axes[1].before:ends[1], :]
    short = [axis.length - (end - axis.before) for axis, end in zip(axes, ends)]
    return tf.pad(grid, [[0, 0], [0, short[0]], [0, short[1]], [0, 0]]) if any(short) else grid


_KINDS = ("Conv2D", "Conv2DBackpropInput")


@dataclasses.dataclass(frozen=True)
class _Axis:
    """One spatial axis of a convolution: the image's length, the filter's,
    the stride, the output's length, the padding before the image."""
    length: int
    kernel: int
    stride: int
    out: int
    before: int

    def tap(self, offset):
        """Slices of the image and of the output gradient that filter tap
        `offset` pairs: output i reads image stride * i + offset - before."""
        first = max(0, -((offset - self.before) // self.stride))
        last = min(self.out, (self.length - 1 - offset + self.before) // self.stride + 1)
        if last <= first:
            return slice(0, 0), slice(0, 0)
        start = self.stride * first + offset - self.before
        return (slice(start, start + self.stride * (last - first - 1) + 1, self.stride),
                slice(first, last))


def roles(op):
    """(image, filter, output) of the convolution `op` is or transposes."""
    if op.type == "Conv2DBackpropInput":
        return op.outputs[0], op.inputs[1], op.inputs[2]
    return op.inputs[0], op.inputs[1], op.outputs[0]


def _strides(op):
    return list(op.get_attr("strides"))


def _axes(op):
    image, w, _ = roles(op)
    same = op.get_attr("padding") == b"SAME"
    axes = []
    for length, kernel, stride in zip(image.shape[1:3], w.shape[:2], _strides(op)[1:3]):
        out = -(-length // stride) if same else (length - kernel) // stride + 1
        padding = max((out - 1) * stride + kernel - length, 0) if same else 0
        axes.append(_Axis(length, kernel, stride, out, padding // 2))
    return axes


@dataclasses.dataclass(frozen=True)
class Half:
    """One of the two gradients our gradient of a convolution makes, its `role`
    "input", "filter", or for a transposed convolution "transposed" (the
    gradient of its `out_backprop` input, a forward Conv2D). Each of its ops
    waits for `gate`, a NoOp that waits for `out_backprop`, the gradient both
    halves read."""
    role: str
    gate: tf.Operation
    out_backprop: tf.Tensor


def half_of(op: tf.Operation):
    """The `Half` whose result `op` makes, or None."""
    return getattr(op, "_scratch_free_half", None)


def _half(role, grad, build):
    """`build()`, its ops behind a gate that waits for `grad`: slices of forward
    tensors wait for the gradient (else the executor takes them in the forward
    pass and holds the copies until backprop), and gradient_order can hold the
    whole half back behind another convolution's gradient."""
    with tf.control_dependencies([grad]):
        gate = tf.no_op(name=f"{role}_gradient_gate")
    with tf.control_dependencies([gate]):
        result = build()
    result.op._scratch_free_half = Half(role, gate, grad)  # pylint: disable=protected-access
    return result


@tf.RegisterGradient(SCRATCH_FREE_GRADIENT)
def _scratch_free_gradient(op, grad):
    axes = _axes(op)
    w = op.inputs[1]
    if not grad.shape[1:].is_fully_defined():
        # Its pads are computed from the incoming gradient's shape (grad_ys fed with
        # an unknown one failed to build): the output's.
        grad = tf.ensure_shape(grad, op.outputs[0].shape)
    if op.type == "Conv2DBackpropInput":
        return (None,) + _transposed_gradients(op, w, op.inputs[2], grad)[::-1]
    return (_half("input", grad, lambda: _input_gradient(axes, w, grad)),
            _half("filter", grad, lambda: _filter_gradient(
                axes, w, op.inputs[0], grad, _batch_parts(op))))


def _transposed_gradients(op, w, out_backprop, grad):
    """(d out_backprop, d filter) of transposed convolution `op` on
    (`out_backprop`, `w`): the Conv2D it transposes, of `grad`, and the per-tap
    filter gradient."""
    padding = op.get_attr("padding").decode()
    return (_half("transposed", grad, lambda: tf.nn.conv2d(grad, w, _strides(op), padding)),
            _half("filter", grad, lambda: _filter_gradient(
                _axes(op), w, grad, out_backprop, _batch_parts(op))))


def _input_gradient(axes, w, grad):
    """dx: the output gradient spread to the image's grid (zeros between, by
    the stride), correlated with the filter flipped in space, its channels
    swapped: a forward Conv2D (its CPU kernel takes little scratch); a 1x1
    filter's is a MatMul before the spreading."""
    kh, kw, channels_in, channels_out = w.shape.as_list()
    if (kh, kw) == (1, 1):
        product = tf.matmul(tf.reshape(grad, [-1, channels_out]),
                            tf.reshape(w, [channels_in, channels_out]), transpose_b=True)
        grad = tf.reshape(product, [-1, axes[0].out, axes[1].out, channels_in])
    spread = _spread(grad, axes)
    pads = [[0, 0]] + [[axis.kernel - 1 - axis.before, axis.length + axis.before - size]
                       for axis, size in zip(axes, spread.shape[1:3])] + [[0, 0]]
    if (kh, kw) != (1, 1):
        # The flip reads the filter alone: unordered, it ran in the forward pass
        # and its two filter-sized results lived until this product (a recomputed
        # copy's, in the keras.io U-Net: 72-288 KiB each).
        with tf.control_dependencies([spread]):
            flipped = tf.transpose(tf.reverse(w, [0, 1]), [0, 1, 3, 2])
        return tf.nn.conv2d(spread, flipped, 1, pads)
    return tf.pad(spread, pads) if any(after for _, after in pads[1:3]) else spread


def _spread(grad, axes):
    """`grad` with stride - 1 zeros after each pixel along each axis, cut to
    what the image's grid reaches (image pixel p pairs spread pixel p + before - tap)."""
    stride_h, stride_w = axes[0].stride, axes[1].stride
    if (stride_h, stride_w) == (1, 1):
        return grad
    padded = tf.pad(grad[:, :, None, :, None, :],
                    [[0, 0], [0, 0], [0, stride_h - 1], [0, 0], [0, stride_w - 1], [0, 0]])
    spread = tf.reshape(padded, [-1, axes[0].out * stride_h, axes[1].out * stride_w,
                                 grad.shape[-1]])
    reach = [min(axis.out * axis.stride, axis.length + axis.before) for axis in axes]
    if reach == spread.shape[1:3].as_list():
        return spread
    return spread[:, :reach[0], :reach[1], :]


def _filter_gradient(axes, w, image, grad, batch_parts=1):
    """dW[a, b] = (image pixels tap (a, b) reads)^T grad, one tap at a time, and
    one of `batch_parts` parts of the batch at a time, summed."""
    kh, kw, channels_in, channels_out = w.shape.as_list()
    batches = _batch_slices(image, batch_parts)
    parts, last = [], []
    for image_rows, grad_rows in map(axes[0].tap, range(kh)):
        for image_cols, grad_cols in map(axes[1].tap, range(kw)):
            products = []
            for batch in batches:
                # One tap's slices of one part alive at a time, whatever the thread count.
                with tf.control_dependencies(last):
                    taken = tf.reshape(image[batch, image_rows, image_cols, :],
                                       [-1, channels_in])
                    part = tf.reshape(grad[batch, grad_rows, grad_cols, :], [-1, channels_out])
                    products.append(tf.matmul(taken, part, transpose_a=True))
                    last = products[-1:]
            parts.append(tf.add_n(products) if len(products) > 1 else products[0])
    return tf.reshape(tf.stack(parts), [kh, kw, channels_in, channels_out])
