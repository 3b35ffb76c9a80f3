//! The shareable CUDA memory pool.
