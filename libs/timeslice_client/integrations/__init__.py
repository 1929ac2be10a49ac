"""Integrations with training frameworks: each one takes the group's hold around a framework's accelerator phases,
gives it back where the framework works on the CPU, and registers the framework's state with an offload handler.

Each lives in a module of its own and imports its framework only when that module is imported (``import
timeslice_client`` never does); a missing framework is one error naming the extra to install:

- :mod:`timeslice_client.integrations.trl`: TRL's ``GRPOTrainer`` (``pip install 'timeslice-client[trl]'``).
- :mod:`timeslice_client.integrations.slime`: slime's phase callback (``--phase-callback-path``); needs no extra.
- :mod:`timeslice_client.integrations.verl`: the phases of veRL's ``RayPPOTrainer.fit`` as holds; needs no extra
  (``examples/verl_timeslice.py`` has the loop with the calls in place).

docs/integrations.md says what each one moves on a switch and what that costs.
"""

__all__: list[str] = []
