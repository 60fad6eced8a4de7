"""Triton kernels of the Triton attention backend (triton_backend.py): split-K decode and prefix + causal extend over
the paged KV pool. Imported only where triton is installed (the backend's module; the tests skip without it)."""
