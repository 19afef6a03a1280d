"""What one process owns: the registry of its objects, their background threads, and the backends
built from settings."""
