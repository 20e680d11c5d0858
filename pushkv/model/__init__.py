"""The model: a Qwen3/Llama transformer with paged attention, its weights and tokenizer.

Imported lazily, so that pure geometry (``pushkv.model.shard``) can be checked
by processes that never load torch (the supervisor, at launch).
"""
__all__ = ["Model", "Tokenizer", "build_model", "get_tokenizer"]


def __getattr__(name):
    if name == "Model":
        from pushkv.model import transformer

        return transformer.Model
    if name == "build_model":
        from pushkv.model import build

        return build.build_model
    if name in ("Tokenizer", "get_tokenizer"):
        from pushkv.model import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module 'pushkv.model' has no attribute {name!r}")
