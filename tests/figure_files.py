"""Checks the experiment tests share: a PNG a script wrote is a real, non-empty image."""
from __future__ import annotations

from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_pngs(folder: Path, names: list[str]) -> None:
    """Each `folder/<name>.png` exists, starts with the PNG signature and an IHDR chunk, and has pixels."""
    for name in names:
        data = (Path(folder) / f"{name}.png").read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert data[12:16] == b"IHDR", name
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 200 and height >= 150, (name, width, height)
        assert len(data) > 5_000 and b"IDAT" in data and data.endswith(b"IEND\xaeB`\x82"), name
