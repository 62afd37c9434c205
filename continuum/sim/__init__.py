"""The simulated inference engine (``continuum-sim``) every integration test, the demo and
the benchmarks run against.

* :mod:`~continuum.sim.tokenizer`, :mod:`~continuum.sim.templates`: a deterministic,
  reversible tokenizer and ChatML / Llama-3 / Mistral chat templates.
* :mod:`~continuum.sim.cache`: the paged prefix-cache model (chained block hashes, LRU,
  refcounts, CPU tier) that emits neutral KV events.
* :mod:`~continuum.sim.latency`, :mod:`~continuum.sim.engine`: timing and request handling.
* :mod:`~continuum.sim.server`: the vLLM-compatible HTTP app and a reusable app factory.
* :mod:`~continuum.sim.cli`: ``continuum-sim`` (one engine or a fleet) and
  :func:`~continuum.sim.cli.start_fleet`.

Importing this package opens no sockets and imports no network library, so it is safe
before gevent's monkey patching.
"""
