"""LightRFT: torch-native, minimal reinforcement fine-tuning for language models."""

__version__ = "0.1.0"
