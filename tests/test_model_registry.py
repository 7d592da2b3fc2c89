"""One way apps register models (issue 31): ``@register_model(app, name)`` + ``create_model(app, name, **kw)``
in `mariana.platform.core.registry`, used by asr, vision and pctr. Every registered model is built and run
forward once on a tiny input."""

from __future__ import annotations

import mariana.apps.asr.model  # noqa: F401  (importing a model module registers its models)
import mariana.apps.pctr.models.nets  # noqa: F401
import mariana.apps.vision.model  # noqa: F401
import pytest
import torch
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.registry import create_model, list_models, register_model

# app -> (its models' keyword arguments at a tiny size, a batch of inputs, the output's shape)
TINY = {
    "vision": (
        {"num_classes": 3, "image_size": 32, "dropout": 0.0},
        lambda: (torch.randn(2, 3, 32, 32),),
        (2, 3),
    ),
    "asr": (
        {
            "num_bins": 5,
            "context": 2,
            "hidden": 8,
            "layers": 2,
            "output_units": 4,
            "activation": "relu",
            "dropout": 0.0,
            "norm": "none",
        },  # fmt: skip
        lambda: (torch.randn(2, 7, 5), torch.tensor([7, 5])),
        (2, 7, 4),
    ),
    "pctr": (
        {"num_rows": 40, "num_fields": 4, "num_dense": 2, "dim": 3, "hidden": (8, 4), "cross_layers": 2},
        lambda: (torch.randint(0, 40, (2, 4)), torch.rand(2, 4), torch.rand(2, 2)),
        (2,),
    ),
}


def test_the_apps_model_names_are_unchanged():
    assert list_models("asr") == ["dnn", "tdnn"]
    assert list_models("vision") == ["mariana-cnn", "mariana-cnn-32", "cifar-fast", "resnet9", "fastnet"]
    assert list_models("pctr") == ["lr", "fm", "dnn", "deepfm", "dcn"]


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_builds_and_runs_forward(name):
    app, model = name.split("/")
    kwargs, inputs, shape = TINY[app]
    torch.manual_seed(0)
    m = create_model(app, model, **kwargs).eval()
    with torch.no_grad():
        out = m(*inputs())
    assert out.shape == shape and torch.isfinite(out).all()


def test_unknown_and_twice_registered_names_are_refused():
    with pytest.raises(MarianaError, match="unknown vision model 'nope': choose one of mariana-cnn, "):
        create_model("vision", "nope")

    def other(**kwargs):  # a factory of another module under a taken name
        raise AssertionError("never built")

    other.__module__ = "somewhere.else"
    with pytest.raises(ValueError, match="registered twice"):
        register_model("asr", "dnn")(other)
    assert list_models("asr") == ["dnn", "tdnn"]
