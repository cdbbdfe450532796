"""AstraFlow data policies: the plug-in API and registry, the stream-processor runtime, curators,
filters, replay, mixing and staleness (DESIGN.md, steps 2, 4, 5, 8, 9).

- :mod:`policies.base`: ``Curator``, ``Filter``, ``ServingPolicy``, ``Decision``, ``PolicyConfigError``.
- :mod:`policies.registry`: ``register_policy``, ``build_policy``, ``build_chain``, ``known_policies``.
- :mod:`policies.processor`: ``FilterProcessor``, ``CuratorGate`` (run by ``astraflow policy`` and ``astraflow acquire``).
- Built-ins: :mod:`policies.curators` (filter_solved, greso), :mod:`policies.filters` (accept_all,
  filter_zero_adv, filter_length, filter_format), :mod:`policies.replay`, :mod:`policies.mix`,
  :mod:`policies.staleness`.
"""
