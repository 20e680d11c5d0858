"""Pure protocol logic: no sockets, no NIXL, no clock reads (``now`` is an argument).

- :mod:`allocator` -- paged block allocator preferring contiguous runs.
- :mod:`tp` -- which tensor-parallel rank holds / produces which KV heads.
- :mod:`mapping` -- block ids to merged byte regions between two KV layouts.
- :mod:`rendezvous` -- P writer's push rendezvous state machine.
- :mod:`arrivals` -- D writer's completion counting.
- :mod:`lease` -- pull mode's leased P blocks (renewed while D still means to read, up to a cap).
"""
