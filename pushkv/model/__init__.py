"""The model: a Qwen3/Llama transformer with paged attention, its weights and tokenizer."""
from pushkv.model.tokenizer import Tokenizer, get_tokenizer
from pushkv.model.transformer import Model, build_model

__all__ = ["Model", "Tokenizer", "build_model", "get_tokenizer"]
