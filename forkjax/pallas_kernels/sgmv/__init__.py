"""Segmented multi-LoRA matmuls: each token against its own adapter slot (triton.py), and
their plain-jnp references (reference.py)."""
