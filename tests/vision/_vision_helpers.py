"""Shared helpers for the vision-language tests."""


def square(colour, size=(56, 56)):
    """A plain-colour RGB PIL image."""
    from PIL import Image

    return Image.new("RGB", size, colour)
