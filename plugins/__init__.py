"""Observers of the engine's event bus."""
