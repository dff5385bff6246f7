"""CPU engines for Ray Serve LLM's LLMEngine protocol, plugged in by import path (see serving.app)."""
