"""Developer tools shipped with the router, all about real processes on 127.0.0.1.

* :mod:`continuum.devtools.procs`: free ports, child processes stopped by PID and bounded
  waits, shared by the demo, the tests and ``tools/``;
* :mod:`continuum.devtools.demo` and :mod:`continuum.devtools.fleet`: ``continuum-router
  demo`` and the processes it runs;
* :mod:`continuum.devtools.redis_server`, :mod:`continuum.devtools.servers` (with
  :mod:`continuum.devtools.fake_upstream`): a throwaway ``redis-server``, a scriptable
  OpenAI-compatible upstream and the router under gunicorn, for end-to-end tests (ours and
  plugins').

Nothing here needs pytest.
"""
