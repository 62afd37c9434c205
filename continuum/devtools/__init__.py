"""Developer tools shipped with the router: the demo, the fleet of child processes it runs,
and the plumbing for ports, child processes and waits that the demo, the tests and
``tools/`` share (:mod:`continuum.devtools.procs`)."""
