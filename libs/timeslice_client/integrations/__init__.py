"""Integrations with training frameworks: each one takes the group's hold around a framework's accelerator phases,
gives it back where the framework works on the CPU, and registers the framework's state with an offload handler.

Each lives in a module of its own and imports its framework only when that module is imported (``import
timeslice_client`` never does); a missing framework is one error naming the extra to install:

- :mod:`timeslice_client.integrations.trl`: TRL's ``GRPOTrainer`` (``pip install 'timeslice-client[trl]'``).

docs/integrations.md says what each one moves on a switch and what that costs.
"""

__all__: list[str] = []
