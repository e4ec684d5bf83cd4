"""Shared helpers for the vision-language tests."""

from _exports import likelihood_reward_model  # noqa: F401  (shared with the audio tests)


def square(colour, size=(56, 56)):
    """A plain-colour RGB PIL image."""
    from PIL import Image

    return Image.new("RGB", size, colour)
