"""``pushkv plan``: the router's cost model driving a discrete-event simulation of a deployment
(pure: no process, no socket). ``workload`` says what arrives, ``profile`` what the hardware
costs, ``sim`` what TTFT and TPOT follow, per mode and per P:D ratio."""
