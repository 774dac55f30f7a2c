"""What `ServeConfig`, the server's settings (the door `make_server` and `python -m orca_torch.serve`
share), refuses, before any model is built or socket bound."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from orca_torch.serve.server import ServeConfig  # noqa: E402


@pytest.mark.parametrize("field, value, says", [
    ("model", "", "model must be non-empty text, got ''"),          # (not Path(""), this directory)
    ("model", None, "model must be non-empty text, got None"),
    ("model", 5, "model must be non-empty text, got 5"),
    ("host", "", "host must be non-empty text, got ''"),             # (not every interface)
    ("host", None, "host must be non-empty text, got None"),
    ("served_model_name", "", "served_model_name must be non-empty text (or None), got ''"),
    ("served_model_name", 5, "served_model_name must be non-empty text (or None), got 5"),
    ("log_steps", "no", "log_steps must be True or False, got 'no'"),
])
def test_text_and_flag_settings_are_refused_saying_what_is_allowed(field, value, says):
    with pytest.raises(ValueError) as e:
        ServeConfig(**{field: value})
    assert says in str(e.value)


def test_the_text_settings_it_takes(tmp_path):
    cfg = ServeConfig(model="tiny", served_model_name="ours", host="localhost", log_steps=True)
    assert cfg.name == "ours" and ServeConfig().name == "tiny"
    ckpt = ServeConfig(model=tmp_path)                  # a checkpoint directory as a Path, kept as its text
    assert ckpt.model == str(tmp_path) and ckpt.name == tmp_path.name
