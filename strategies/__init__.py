"""The built-in selection strategies, one module each, registered under the
``continuum.strategies`` entry-point group. The core never imports this package directly.
"""
