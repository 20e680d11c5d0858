"""NIXL transport: the only code that touches a NIXL agent."""
