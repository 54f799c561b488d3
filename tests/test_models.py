"""nanolatent/models.py's typing of a model's values, as build_model (every script) runs it before a Config sees them:
a value of the wrong type, out of its range or NaN is one ValueError naming field and value (the scripts print it as
one line), and a config read from JSON takes lists for tuples and ints for floats."""

import re

import pytest

from nanolatent import models


@pytest.mark.parametrize("model_type", ["det", "eve", "free", "btrans"])
@pytest.mark.parametrize("values, named", [
    ({"n_head": 0}, "n_head=0"),
    ({"vocab_size": -1}, "vocab_size=-1"),
    ({"norm_eps": 0.0}, "norm_eps=0.0"),
    ({"rope_theta": -1.0}, "rope_theta=-1.0"),
])
def test_every_model_refuses_a_bad_shared_value_where_the_scripts_build_it(model_type, values, named):
    """models.typed_values, then the Config, as build_model does: one ValueError naming field and value."""
    module = __import__(f"model_{model_type}")
    with pytest.raises(ValueError) as error:
        module.Config(**models.typed_values(model_type, values))
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("model_type", ["det", "eve", "free", "btrans"])
@pytest.mark.parametrize("values, message", [
    ({"ffn_hidden": "abc"}, "ffn_hidden='abc': must be None or an int"),
    ({"n_layer": 2.5}, "n_layer=2.5: must be an int"),
    ({"tie_embeddings": "yes"}, "tie_embeddings='yes': must be a bool"),
    ({"rope_theta": float("inf")}, "rope_theta=inf: must be a finite float"),
])
def test_every_model_value_of_the_wrong_type_is_named_where_the_scripts_build_a_model(model_type, values, message):
    """models.typed_values, which build_model runs before a Config sees the values: one ValueError naming field,
    value and type (the scripts print it as one line)."""
    with pytest.raises(ValueError) as error:
        models.typed_values(model_type, values)
    assert str(error.value) == message


@pytest.mark.parametrize("model_type, values, named", [
    ("free", {"latent_bits": 30}, "latent_bits=30"),
    ("free", {"kappa_bits": -1.0}, "kappa_bits=-1.0"),
    ("eve", {"latent_dim": 0}, "latent_dim=0"),
    ("eve", {"mu2_band": (0.1,)}, "mu2_band=(0.1,)"),
    ("eve", {"homeostat_ema": 1.0}, "homeostat_ema=1.0"),
])
def test_a_model_value_out_of_its_range_is_named(model_type, values, named):
    """Through models.typed_values and the Config, as build_model (every script) does: a ValueError naming it."""
    with pytest.raises(ValueError) as error:
        __import__(f"model_{model_type}").Config(**models.typed_values(model_type, values))
    assert named in str(error.value) and "\n" not in str(error.value)


def test_a_nan_model_value_is_named_before_a_config_sees_it():
    with pytest.raises(ValueError, match=re.escape("sigma=nan: must be a finite float")):
        models.typed_values("btrans", {"sigma": float("nan")})


def test_a_config_from_json_takes_lists_for_tuples_and_ints_for_floats():
    typed = models.typed_values("eve", {"mu2_band": [0.08, 0.145], "kl_beta": 1})
    assert typed["mu2_band"] == (0.08, 0.145) and type(typed["kl_beta"]) is float
    config = models.build_model("eve", {**typed, "vocab_size": 50, "n_layer": 2, "n_embd": 32}).config
    assert config.mu2_band == (0.08, 0.145) and type(config.kl_beta) is float
