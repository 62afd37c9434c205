"""Cache-store and KV-index implementations, registered through entry points.

Groups: ``continuum.cache_stores`` and ``continuum.kv_indexes``. The core never imports this
package; it finds these plugins by name, as it finds a third party's.
"""
