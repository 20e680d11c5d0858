"""Supervisor: plans a deployment, starts its processes, watches and stops them."""
from pushkv.supervisor.plan import ProcessSpec, plan_deployment, process_specs
from pushkv.supervisor.supervisor import Supervisor
from pushkv.supervisor.table import ProcessTable, RestartPolicy, State

__all__ = [
    "ProcessSpec", "ProcessTable", "RestartPolicy", "State", "Supervisor",
    "plan_deployment", "process_specs",
]
