"""Engines a worker drives: the protocol, vLLM and its scheduler, the simulator."""
