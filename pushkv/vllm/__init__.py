"""pushkv's push KV transfer inside vLLM 0.32 (``pip install pushkv[vllm]``).

vLLM loads the connector with ``"kv_connector": "PushKVConnector",
"kv_connector_module_path": "pushkv.vllm"``. The class is imported lazily so
that the pure parts (params, regions, the writer) import without vLLM, and
nothing in pushkv's core imports this package.
"""

__all__ = ["PushKVConnector"]


def __getattr__(name):
    if name == "PushKVConnector":
        from pushkv.vllm.connector import PushKVConnector

        return PushKVConnector
    raise AttributeError(f"module 'pushkv.vllm' has no attribute {name!r}")
