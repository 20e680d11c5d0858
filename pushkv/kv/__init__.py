"""KV pool: physical layout, memory ownership, block-to-byte mapping."""
