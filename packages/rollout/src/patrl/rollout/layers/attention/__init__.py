"""Attention behind one interface: metadata in a context object, backends in a registry."""
