"""The figures: a path that names no file to write (a directory, a name without a suffix, no name at
all) is refused before anything is drawn, rather than written to that name plus '.png'."""
from __future__ import annotations

import pytest

from orca_torch.lab import plots

pytest.importorskip("matplotlib")


@pytest.mark.parametrize("name, says", [
    ("figs", r"path '.*figs' is a directory; give a file name, e.g. '.*figs/figure.png'"),
    ("cdf", r"path '.*cdf' has no suffix \(matplotlib would write '.*cdf.png'\); give the file name with its "
            r"format, e.g. '.*cdf.png'"),
    (None, "path must be a file name .* got None"),
    ("", "path must be a file name .* got ''"),
])
def test_a_path_that_names_no_file_is_refused_and_nothing_is_written(tmp_path, name, says):
    (tmp_path / "figs").mkdir()
    path = None if name is None else name if not name else tmp_path / name
    with pytest.raises(ValueError, match=says):
        plots.distributions(path, {"a": [1.0, 2.0]}, "s", "t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs"] and not list((tmp_path / "figs").iterdir())
