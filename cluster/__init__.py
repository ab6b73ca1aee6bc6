"""Speculation-aware LLM inference cluster on Ray Serve and vLLM."""
