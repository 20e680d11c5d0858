"""The network-namespace "hosts" harness for tests; it lives in ``tools/netns.py`` so that tools
(``tools/tcp_write_report.py``) can make hosts too. See there for the details."""
from tools.netns import (Host, Network, hosts, leftovers, list_links, list_namespaces, make, remove,
                         sweep_stale)

__all__ = ["Host", "Network", "hosts", "leftovers", "list_links", "list_namespaces", "make", "remove",
           "sweep_stale"]
