# gunicorn -k gevent -c conf/gunicorn.conf.py 'continuum.app:get_app()'  (worker class set here)
# All settings live in continuum/gunicorn_conf.py so an installed router needs no checkout;
# override any of them below or with gunicorn command-line flags.
from continuum.gunicorn_conf import *  # noqa: F403
from continuum.gunicorn_conf import child_exit, on_exit, when_ready  # noqa: F401
