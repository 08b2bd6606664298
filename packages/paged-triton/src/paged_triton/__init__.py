"""paged-triton: fused Triton kernels with the reference ops' signatures."""
