//! Proof that the property test can fail: for each invariant, a deliberately broken
//! transition (see `crate::mutation`) that the same property, with the same strategy and the
//! same case count, must reject, naming that invariant.

use std::sync::Once;

use proptest::test_runner::{TestError, TestRng, TestRunner};
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest};

use super::property::{Contract, Model, STEPS, config};

static QUIET: Once = Once::new();

/// Run the property with mutation `M` and return the failure message of the minimal case.
fn caught<const M: u8>() -> String {
    // The property fails by panicking; proptest catches the panic. Keep the hundreds of
    // panics while shrinking out of the output, on these tests' threads only.
    QUIET.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().map(str::to_owned);
            if !name.is_some_and(|n| n.contains("property_catches_")) {
                report(info);
            }
        }));
    });
    let config = config();
    // A fixed seed: each mutation is caught within a few dozen cases, and CI sees the
    // same minimal sequence every run.
    let rng = TestRng::deterministic_rng(config.rng_algorithm);
    let mut runner = TestRunner::new_with_rng(config.clone(), rng);
    let result = runner.run(
        &Model::sequential_strategy(STEPS),
        |(initial, transitions, seen)| {
            Contract::<M>::test_sequential(config.clone(), initial, transitions, seen);
            Ok(())
        },
    );
    match result {
        Err(TestError::Fail(reason, (_, minimal, _))) => {
            format!("{reason}\nminimal sequence: {minimal:?}")
        }
        Err(TestError::Abort(reason)) => panic!("mutation {M}: property aborted: {reason}"),
        Ok(()) => panic!(
            "mutation {M} survived {} cases: the property cannot see it",
            config.cases
        ),
    }
}

fn assert_names(message: &str, invariant: u8) {
    // Evidence for the record (`cargo nextest run --no-capture` shows it).
    eprintln!("mutation for invariant {invariant} caught:\n{message}");
    assert!(
        message.contains(&format!("invariant {invariant} (")),
        "the property failed, but not on invariant {invariant}:\n{message}"
    );
}

#[test]
fn property_catches_a_result_granted_in_memory_the_parent_never_allocated() {
    assert_names(&caught::<1>(), 1);
}

#[test]
fn property_catches_memory_used_before_waiting_on_ready() {
    assert_names(&caught::<2>(), 2);
}

#[test]
fn property_catches_an_ack_sent_before_the_unimport() {
    assert_names(&caught::<3>(), 3);
}

#[test]
fn property_catches_a_release_without_waiting_on_done() {
    assert_names(&caught::<4>(), 4);
}

#[test]
fn property_catches_a_release_at_hang_up_before_the_worker_is_reaped() {
    assert_names(&caught::<5>(), 5);
}

#[test]
fn property_catches_a_second_import_of_the_same_allocation() {
    assert_names(&caught::<6>(), 6);
}

#[test]
fn property_catches_an_allocation_above_the_import_limit_offered_by_pointer() {
    assert_names(&caught::<7>(), 7);
}

#[test]
fn property_catches_a_reaped_workers_handoffs_never_released() {
    assert_names(&caught::<8>(), 8);
}

#[test]
fn property_catches_arena_blocks_returned_before_the_worker_is_reaped() {
    assert_names(&caught::<9>(), 5);
}

#[test]
fn property_catches_an_arena_copy_block_returned_before_done() {
    assert_names(&caught::<10>(), 4);
}

#[test]
fn property_catches_a_slices_unused_tail_returned_before_done() {
    assert_names(&caught::<11>(), 4);
}
