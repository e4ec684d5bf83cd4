"""LightRFT: torch-native, minimal reinforcement fine-tuning for language models."""

import logging as _logging

__version__ = "0.1.0"


def _drop_torchao_cpp_notice(record: _logging.LogRecord) -> bool:
    # torchtune imports torchao, whose optional C++ kernels are built for another torch version;
    # LightRFT never calls them, so the notice printed on every command is noise. Only this one
    # message is dropped: every other torchao warning still shows.
    return not record.getMessage().startswith("Skipping import of cpp extensions")


_logging.getLogger("torchao").addFilter(_drop_torchao_cpp_notice)
