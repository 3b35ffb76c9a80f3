//! Test harness shared by the multi-process and hardware tests.
