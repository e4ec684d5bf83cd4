"""Shared helpers for the vision-language tests: small PIL images and data files."""

import pytest
from _vision_helpers import square


@pytest.fixture
def image_files(tmp_path):
    """Three PNG files (different sizes) beside the data files of a test."""
    paths = []
    for k, (colour, size) in enumerate(
        [((255, 0, 0), (56, 56)), ((0, 200, 0), (84, 56)), ((0, 0, 255), (40, 70))]
    ):
        p = tmp_path / f"img{k}.png"
        square(colour, size).save(p)
        paths.append(p)
    return paths
