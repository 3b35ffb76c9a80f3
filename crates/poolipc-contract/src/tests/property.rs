//! The contract against a small reference model: random operation sequences with faults,
//! every invariant checked after every step.

use proptest::prelude::*;
use proptest::strategy::Union;
use proptest::test_runner::{Config, TestRng, TestRunner};
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

use crate::mutation::Mutation;
use crate::sim::{Fault, Op, SizeClass, World};

/// Cases per run, fixed here so that CI runs this many whatever its environment says.
pub(crate) const CASES: u32 = 10_000;
/// Steps per case.
pub(crate) const STEPS: std::ops::Range<usize> = 1..48;

/// The reference model. It knows what the outside world did (workers started, shutdown) and
/// generates operations; [`World`] holds the model's expectations of each call's outcome
/// (which lends must succeed, which handoffs must be outstanding) and the [`crate::audit::Auditor`].
#[derive(Clone, Debug, Default)]
pub(crate) struct Model {
    workers: usize,
    shut_down: bool,
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        Just(Fault::DoneOfAnotherJob),
        Just(Fault::AckBeforeDone),
        Just(Fault::SecondResultRequest),
        Just(Fault::LyingByteLen),
        Just(Fault::ErrorMessage),
        Just(Fault::Unexpected),
        Just(Fault::LyingCarve),
    ]
}

fn size() -> impl Strategy<Value = SizeClass> {
    prop_oneof![
        6 => Just(SizeClass::Small),
        1 => Just(SizeClass::AtLimit),
        1 => Just(SizeClass::Unaligned),
        1 => Just(SizeClass::Huge),
    ]
}

impl ReferenceStateMachine for Model {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Op> {
        // Called before every step: build each of the four variants once per thread.
        thread_local! {
            static CACHE: std::cell::RefCell<[Option<BoxedStrategy<Op>>; 4]> =
                const { std::cell::RefCell::new([None, None, None, None]) };
        }
        let key = usize::from(state.workers == 0) * 2 + usize::from(state.shut_down);
        CACHE.with(|cache| {
            cache.borrow_mut()[key]
                .get_or_insert_with(|| transitions_for(state))
                .clone()
        })
    }

    fn apply(mut state: Model, op: &Op) -> Model {
        match op {
            Op::SpawnWorker if !state.shut_down => {
                state.workers = (state.workers + 1).min(World::MAX_WORKERS);
            }
            Op::Shutdown => state.shut_down = true,
            _ => {}
        }
        state
    }
}

/// The operations, weighted. Depends on the model only through whether a worker exists and
/// whether the parent is shutting down.
fn transitions_for(state: &Model) -> BoxedStrategy<Op> {
    if state.workers == 0 && !state.shut_down {
        // Nothing else can happen before the first worker: start with it.
        return Just(Op::SpawnWorker).boxed();
    }
    let w = any::<u8>;
    let pick = any::<u8>;
    let mut arms: Vec<(u32, BoxedStrategy<Op>)> = vec![
        (2, Just(Op::SpawnWorker).boxed()),
        (
            6,
            (w(), 0u8..4, any::<u16>(), size())
                .prop_map(|(worker, inputs, plan, size)| Op::StartJob {
                    worker,
                    inputs,
                    plan,
                    size,
                })
                .boxed(),
        ),
        (2, pick().prop_map(|pick| Op::DropTensor { pick }).boxed()),
        (
            5,
            (
                w(),
                pick(),
                prop_oneof![1 => Just(0u8), 6 => 1u8..3],
                size(),
            )
                .prop_map(|(worker, pick, count, size)| Op::RequestResults {
                    worker,
                    pick,
                    count,
                    size,
                })
                .boxed(),
        ),
        (
            6,
            (
                pick(),
                size(),
                prop::bool::weighted(0.3),
                prop::bool::weighted(0.3),
                prop::bool::weighted(0.15),
            )
                .prop_map(|(pick, size, staged, arena, decline)| Op::AnswerResult {
                    pick,
                    size,
                    staged,
                    arena,
                    decline,
                })
                .boxed(),
        ),
        (
            14,
            w().prop_map(|worker| Op::DeliverToWorker { worker })
                .boxed(),
        ),
        (
            14,
            w().prop_map(|worker| Op::DeliverToParent { worker })
                .boxed(),
        ),
        (
            3,
            (w(), pick())
                .prop_map(|(worker, pick)| Op::Access { worker, pick })
                .boxed(),
        ),
        (
            7,
            (w(), pick())
                .prop_map(|(worker, pick)| Op::Finish { worker, pick })
                .boxed(),
        ),
        (
            4,
            prop_oneof![5 => 0u16..20, 1 => 80u16..200]
                .prop_map(|millis| Op::Advance { millis })
                .boxed(),
        ),
        (4, Just(Op::Timeout).boxed()),
        (5, w().prop_map(|worker| Op::Reap { worker }).boxed()),
    ];
    // Faults and endings are rare beside the happy path, so most sequences get far into
    // the jobs before something goes wrong.
    for arm in &mut arms {
        arm.0 *= 3;
    }
    if !state.shut_down {
        arms.push((1, Just(Op::Shutdown).boxed()));
    }
    let faults: Vec<(u32, BoxedStrategy<Op>)> = vec![
        (
            1,
            (w(), any::<bool>(), pick())
                .prop_map(|(worker, to_parent, pick)| Op::Reorder {
                    worker,
                    to_parent,
                    pick,
                })
                .boxed(),
        ),
        (
            1,
            (w(), any::<bool>(), pick())
                .prop_map(|(worker, to_parent, pick)| Op::Lose {
                    worker,
                    to_parent,
                    pick,
                })
                .boxed(),
        ),
        (
            1,
            (w(), any::<bool>(), pick())
                .prop_map(|(worker, to_parent, pick)| Op::Duplicate {
                    worker,
                    to_parent,
                    pick,
                })
                .boxed(),
        ),
        (2, w().prop_map(|worker| Op::Crash { worker }).boxed()),
        (
            2,
            (w(), pick())
                .prop_map(|(worker, pick)| Op::Cancel { worker, pick })
                .boxed(),
        ),
        (
            3,
            (w(), pick())
                .prop_map(|(worker, pick)| Op::FailJob { worker, pick })
                .boxed(),
        ),
        (1, w().prop_map(|worker| Op::StopWorker { worker }).boxed()),
        (
            1,
            (w(), fault(), pick())
                .prop_map(|(worker, fault, pick)| Op::Garbage {
                    worker,
                    fault,
                    pick,
                })
                .boxed(),
        ),
    ];
    arms.extend(faults);
    Union::new_weighted(arms).boxed()
}

/// The system under test: the simulated world, with mutation `M` switched on
/// (`0` is none; `1..=8` break the invariant of that number, `9` returns arena blocks before
/// the worker is reaped, which breaks invariant 5, `10` returns arena-copy input blocks
/// without waiting on DONE, which breaks invariant 4, `11` returns an arena slice's unused
/// tail before waiting on DONE, which breaks invariant 4; see [`mutation_for`]).
pub(crate) struct Contract<const M: u8>;

pub(crate) fn mutation_for(m: u8) -> Option<Mutation> {
    match m {
        1 => Some(Mutation::GrantBeforeAllocation),
        2 => Some(Mutation::UseBeforeReady),
        3 => Some(Mutation::AckBeforeUnimport),
        4 => Some(Mutation::ReleaseWithoutWaitingDone),
        5 => Some(Mutation::ReleaseAtHangUp),
        6 => Some(Mutation::ImportEveryOffer),
        7 => Some(Mutation::IgnoreImportLimit),
        8 => Some(Mutation::ForgetDeadWorkersLoans),
        9 => Some(Mutation::ReleaseArenaAtHangUp),
        10 => Some(Mutation::ReturnArenaCopyBeforeDone),
        11 => Some(Mutation::ReturnSliceTailBeforeDone),
        _ => None,
    }
}

impl<const M: u8> StateMachineTest for Contract<M> {
    type SystemUnderTest = World;
    type Reference = Model;

    fn init_test(_: &Model) -> World {
        World::with_mutation(mutation_for(M))
    }

    fn apply(mut world: World, _: &Model, op: Op) -> World {
        if let Err(failure) = world.step(&op) {
            panic!("after {op:?}:\n{failure}");
        }
        world
    }

    fn check_invariants(world: &World, model: &Model) {
        // The model's view of the outside world agrees with the parent's.
        assert_eq!(
            world.workers_started(),
            model.workers,
            "workers started: world vs model"
        );
        assert!(
            !world.parent().is_shut_down() || model.shut_down,
            "shut down without being asked"
        );
    }
}

pub(crate) fn config() -> Config {
    Config {
        cases: CASES,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    }
}

prop_state_machine! {
    #![proptest_config(config())]

    /// Every invariant holds after every step of any operation sequence, faults included.
    #[test]
    fn every_invariant_holds_after_every_step_under_faults(sequential STEPS => Contract<0>);
}

/// The paths a sequence must be able to reach, or the property above would hold vacuously.
const PATHS: [&str; 34] = [
    "deadline expired",
    "parent ignored a late message",
    "worker refused a stale message",
    "start_job refused",
    "lend",
    "lend with a staged input",
    "lend with an arena copy",
    "lend by VMM handle",
    "lend with a slice",
    "slice carved",
    "release a carved slice",
    "send staged",
    "grant a pointer result",
    "grant a staged result",
    "grant an arena result",
    "refuse results",
    "receive staged",
    "worker: send staged",
    "free unused result",
    "release completed",
    "release cancelled",
    "release failed",
    "kill worker",
    "cancel",
    "bye",
    "shutdown complete",
    "import shared by two handoffs",
    "two jobs in flight on one worker",
    "job completed",
    "job finished with the worker's error",
    "job failed",
    "worker removed",
    "garbage condemned its worker",
    "stopped worker exited",
];

#[test]
fn the_generated_sequences_reach_every_path_of_the_contract() {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    let seen: Arc<Mutex<BTreeMap<&'static str, u64>>> = Arc::default();
    let sink = Arc::clone(&seen);
    let config = Config {
        cases: 1_000,
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::deterministic_rng(config.rng_algorithm);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let run = runner.run(&Model::sequential_strategy(STEPS), move |(_, ops, _)| {
        let mut world = World::new();
        for op in &ops {
            world
                .step(op)
                .map_err(|f| TestCaseError::fail(f.to_string()))?;
        }
        let mut total = sink.lock().map_err(|_| TestCaseError::fail("poisoned"))?;
        for (path, n) in world.coverage() {
            *total.entry(path).or_insert(0) += n;
        }
        Ok(())
    });
    assert!(run.is_ok(), "{run:?}");
    let seen = seen.lock().expect("not poisoned");
    eprintln!("paths taken in 1 000 cases: {seen:#?}");
    for path in PATHS {
        assert!(
            seen.get(path).is_some_and(|n| *n > 0),
            "never reached: {path}"
        );
    }
}
