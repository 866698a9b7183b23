"""The benchmark model families by name (`FAMILIES`).

The block-built families (`block_models.py`) are swept over their depth. The
image families (keras.applications and U-Nets, `image_models.py`) are whole
Keras models instead: their size is the image side in pixels, and they have
no blocks.
"""

import functools

from benchmarks import image_models
from benchmarks.block_models import (build_bert, build_gpt2, build_llama, build_mlp,
                                     build_resnet, build_rnn, cross_entropy, data_bert,
                                     data_decoder, data_mlp, data_resnet, data_rnn)
from benchmarks.model_types import Family, Model

# The decoders from 4 layers (issue 15's size) on: at 2 their LM head's logits
# and its gradient (vocab 1000 per token) set the smallest feasible budget above
# 30% of tf.gradients' activation memory, so `ours(budget 30%)` has no plan.
DECODER_SIZES = (4, 8)

FAMILIES = {f.name: f for f in [
    Family("mlp", "residual MLP, width 128, blocks h + Dense(Dense(h, relu))",
           sizes=(16, 64, 256), quick_sizes=(16,), maxbatch_size=64, batch=1024, quick_batch=512,
           options={"width": 128}, build=build_mlp, data=data_mlp,
           remat_layers=lambda size: [f"block{i}_fc" for i in range(size)]),
    Family("resnet", "CIFAR ResNet (conv + batch norm), 16/32/64 channels, 32x32x3",
           sizes=(3, 9, 27), quick_sizes=(3,), maxbatch_size=9, batch=32, quick_batch=16,
           options={}, build=build_resnet, data=data_resnet,
           remat_layers=lambda size: [f"block{i}_conv1" for i in range(size)]),
    Family("bert", "BERT-like encoder, seq 128, hidden 128, 4 heads, FFN 512, dropout 0.1",
           sizes=(2, 4, 8), quick_sizes=(2,), maxbatch_size=4, batch=16, quick_batch=4,
           options={}, build=build_bert, data=data_bert,
           remat_layers=lambda size: [f"block{i}_ffn_up" for i in range(size)]),
    Family("gpt2", "GPT-2-style decoder (pre-LN, causal attention, GELU MLP 4x, learned "
           "positions, tied LM head), seq 128, hidden 128, 4 heads, dropout 0.1",
           sizes=DECODER_SIZES, quick_sizes=(2,), maxbatch_size=4, batch=16, quick_batch=4,
           options={}, build=build_gpt2, data=data_decoder,
           remat_layers=lambda size: [f"block{i}_ffn_up" for i in range(size)]),
    Family("llama", "Llama-style decoder (RMSNorm, causal attention with rotary "
           "positions, SwiGLU MLP 352, no biases, no dropout), seq 128, hidden 128, 4 heads",
           sizes=DECODER_SIZES, quick_sizes=(2,), maxbatch_size=4, batch=16, quick_batch=4,
           options={}, build=build_llama, data=data_decoder,
           remat_layers=lambda size: [f"block{i}_ffn_up" for i in range(size)]),
    Family("rnn", "residual stack of LSTM(128) layers, 16 time steps",
           sizes=(1, 2, 4), quick_sizes=(1,), maxbatch_size=4, batch=512, quick_batch=512,
           options={}, build=build_rnn, data=data_rnn,
           remat_layers=lambda size: [f"block{i}_lstm" for i in range(size)]),
]}


def whole_model(build_net):
    """build(size, **options) -> Model for `build_net(pixels, classes)`, a Keras
    model returning logits: the stem is the whole net, there are no blocks."""
    def build(size, classes=10, **_):
        net = build_net(size, classes)
        return Model(stem=lambda x, training: net(x, training=training), blocks=[],
                     head=lambda logits, labels: cross_entropy(logits, labels),
                     layers=[net])
    return build


def _image_family(name, what, build_net, classes=10, per_pixel=False, sizes=(64, 96)):
    return Family(
        name, what, sizes=sizes, quick_sizes=sizes[:1], maxbatch_size=sizes[0], batch=8,
        quick_batch=8, options={"classes": classes}, build=whole_model(build_net),
        data=functools.partial(image_models.image_data, per_pixel=per_pixel),
        remat_layers=lambda size: [], size_unit="px")


IMAGE_FAMILIES = [
    *(_image_family(app, f"keras.applications.{app}, weights=None, 10 classes",
                    functools.partial(image_models.application, app))
      for app in image_models.APPLICATIONS),
    *(_image_family(app, f"keras.applications.{app}, weights=None, 10 classes (held out)",
                    functools.partial(image_models.application, app), sizes=(pixels,))
      for app, pixels in image_models.HELD_OUT.items()),
    _image_family("unet", "classic U-Net (concatenated skips), 3 levels, width 16, 3 classes "
                  "per pixel", image_models.unet_classic, classes=3, per_pixel=True),
    _image_family("unet_keras_io", "U-Net of the keras.io segmentation example (separable "
                  "convs, added residuals), 3 classes per pixel", image_models.unet_keras_io,
                  classes=3, per_pixel=True),
]
FAMILIES.update((f.name, f) for f in IMAGE_FAMILIES)
