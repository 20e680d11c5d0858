"""Reading a deployment's trace: ``tap`` attaches and records (the only part with sockets),
``timeline`` turns events into per-request timelines and a Perfetto trace, ``merge`` puts
several hosts' traces on one clock. ``timeline`` and ``merge`` are pure."""
