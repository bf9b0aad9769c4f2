"""`MemoryRegions` implementations: storage-freeing regions (CPU) and torch_memory_saver (CUDA)."""
