"""The benchmark's image families (keras.applications, U-Nets) and the methods they take.

What the benchmark runs is checked here without measuring anything: the
`--quick` smoke test (`python -m benchmarks.run --quick`, CI) measures the
classic U-Net; the big models are left out of it.
"""

import numpy as np
import pytest

pytest.importorskip("tqdm", reason="needs the benchmark extras: pip install -e .[bench]")

from benchmarks import pareto, run  # noqa: E402  (after the skip)
from benchmarks.methods import BUDGET_SHARES, METHODS, applies_to  # noqa: E402
from benchmarks.models import FAMILIES, IMAGE_FAMILIES  # noqa: E402

HAND_CUT = ("tf.recompute_grad", "ours(list)", "ours(collection)",
            "keras.RematScope(list_of_layers)")


def test_hand_cut_methods_only_on_models_with_blocks():
    for family in IMAGE_FAMILIES:
        chosen = run.methods_for(run.parse_args(["--models", family.name]), family.name)
        assert not set(HAND_CUT) & set(chosen), family.name
        assert {"ours(memory)", "ours(speed)", "ours(budget 50%)"} <= set(chosen)
    chosen = run.methods_for(run.parse_args(["--models", "resnet"]), "resnet")
    assert set(HAND_CUT) <= set(chosen)
    assert all(applies_to(m, FAMILIES["mlp"]) for m in METHODS)


def test_quick_run_keeps_the_big_models_out():
    quick = run.parse_args(["--quick"]).models
    assert "unet" in quick
    assert not {"MobileNetV2", "EfficientNetB0", "DenseNet121", "ResNet50"} & set(quick)
    assert run.parse_args([]).models == list(run.SWEPT)


@pytest.mark.parametrize("floor", [0.2, 0.45, 0.8])
def test_budget_sweep_runs_from_the_smallest_feasible_budget_to_tf_gradients(floor):
    shares = pareto.budget_shares(floor, points=3)
    assert shares == sorted(shares)
    assert floor < shares[0] < floor * 1.01 and shares[-1] == 1
    assert {s for s in BUDGET_SHARES if s > floor} <= set(shares)


def test_image_family_builds_and_samples_at_its_size():
    family = FAMILIES["unet"]
    model = family.build(32, **family.options)
    inputs, labels = family.sample(32, 2, **family.options)
    assert inputs.shape == (2, 32, 32, 3) and labels.shape == (2, 32, 32)
    loss = model.forward(inputs, labels, training=False)
    assert np.isfinite(float(loss)) and not model.blocks and model.weights
    with pytest.raises(ValueError, match="no blocks"):
        METHODS["tf.recompute_grad"]().forward(model, inputs, labels)


def test_keras_fit_builds_keras_applications_models_by_name():
    from benchmarks import keras_fit
    model, x, y = keras_fit.build("MobileNetV3Small")
    assert x.shape == (32, 96, 96, 3) and len(y) == 32
    assert model(x[:1]).shape == (1, 4)
    with pytest.raises(ValueError, match="keras.applications"):
        keras_fit.build("NoSuchNet")


def test_keras_fit_reports_the_whole_peak_beside_the_activations():
    from benchmarks import keras_fit
    stock = {"peak_mib": 100.0, "grad_mib": 40.0, "step_s": 2.0}
    ours = {"peak_mib": 55.0, "grad_mib": 40.0, "step_s": 2.5}
    assert keras_fit.ratios(ours, stock) == pytest.approx(
        {"peak_ratio": 0.55, "activation_ratio": 0.25, "time_ratio": 1.25})


def test_plan_objectives_prices_fit_candidates_both_ways():
    """The benchmark traces a fit step and prices the planner's candidates with
    the weight gradients held and as taken; on MobileNetV3Small they save."""
    from benchmarks import plan_objectives
    rows, (held, taken) = plan_objectives.candidates("MobileNetV3Small")
    assert len(rows) > 1
    assert all(flops > 0 for _, _, flops in rows)
    assert min(r[0] for r in rows) < held and min(r[1] for r in rows) < taken
