"""AstraFlow data policies: the plug-in API and registry, the stream-processor runtime, curators,
filters and replay (DESIGN.md, steps 2, 4, 5, 8). Staleness is bounded by the serving stage
(:mod:`consumers.serving`, ``max_staleness``) and corrected by the trainer's loss (``correction``);
sources are mixed by weight at acquisition (``data.sources[].weight``).

- :mod:`policies.base`: ``Curator``, ``Filter``, ``ServingPolicy``, ``Decision``, ``PolicyConfigError``.
- :mod:`policies.config`: the typed configs of the built-ins and of a user's ``module:Class``, in the discriminated
  unions a run config's ``filters``, ``curators`` and ``serving`` are read through; ``policy_spec``.
- :mod:`policies.staleness`: ``staleness``, ``too_stale``: the one staleness rule serving, RaaS and the trainer apply.
- :mod:`policies.registry`: ``register_policy``, ``build_policy``, ``build_chain``, ``build_serving``,
  ``known_policies``.
- :mod:`policies.processor`: ``FilterProcessor``, ``CuratorGate`` (run by ``astraflow policy`` and ``astraflow acquire``).
- Built-ins: :mod:`policies.curators` (filter_solved, greso), :mod:`policies.filters` (accept_all,
  filter_zero_adv, filter_length, filter_format), :mod:`policies.replay`.
"""
