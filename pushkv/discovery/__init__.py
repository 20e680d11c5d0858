"""Discovery: which P and D instances exist and how to reach them.

One small interface (``base.Discovery``) with two implementations: the single-host
one (every instance planned by this host's supervisor; deaths come from its
lifecycle events) and etcd (instances register under a lease; the router watches).
The router and the supervisor use only the interface; records are ``records.py``.
"""
