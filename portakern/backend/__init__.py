"""The backends: one file per backend (numpy, opencl with its simulator oclgrind, cuda, jax),
what every backend is (``base``: probing, a device, and the allocator/compiler/program parts)
and the registry that loads them (``registry``; ``pk.backends()`` is its report)."""
