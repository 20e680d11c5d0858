"""What the tests share: deployments (``deploy``), bare processes (``procs``), namespace hosts
(``netns``, ``hosts_up``), a real etcd (``etcd_server``), fake children and routers, and the
children the tests start with ``python -m tests.support.NAME``."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
