//! Arbitrary operation sequences against the ownership contract: both machines speaking the
//! wire messages, a faulty network, crashing, stopping and misbehaving workers, staged and
//! pointer handoffs, a slow allocator and a clock, in poolipc-contract's simulated world. No
//! input may make either machine panic, and every invariant must hold after every step.
#![no_main]

use libfuzzer_sys::fuzz_target;
use poolipc_contract::sim::{Op, World};

/// Longer sequences add little that shorter ones cannot reach, and slow each run.
const MAX_STEPS: usize = 256;

fuzz_target!(|ops: Vec<Op>| {
    let mut world = World::new();
    for op in ops.iter().take(MAX_STEPS) {
        if let Err(failure) = world.step(op) {
            panic!("after {op:?}:\n{failure}");
        }
    }
});
