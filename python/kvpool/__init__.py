"""kvpool: a Rust-accelerated KV-cache block manager for LLM serving engines."""
from kvpool._core import *  # noqa: F401,F403
