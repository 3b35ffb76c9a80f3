//! The contract against a small reference model: random operation sequences with faults,
//! every invariant checked after every step.

use proptest::prelude::*;
use proptest::strategy::Union;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

use crate::mutation::Mutation;
use crate::sim::{Op, SizeClass, World};

/// Cases per run, fixed here so that CI runs this many whatever its environment says.
pub(crate) const CASES: u32 = 10_000;
/// Steps per case.
pub(crate) const STEPS: std::ops::Range<usize> = 1..40;

/// The reference model. It knows what the outside world did (workers started, shutdown) and
/// generates operations; [`World`] holds the model's expectations of each call's outcome
/// (which lends must succeed, which handoffs must be outstanding) and the [`crate::audit::Auditor`].
#[derive(Clone, Debug, Default)]
pub(crate) struct Model {
    workers: usize,
    shut_down: bool,
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
        let w = any::<u8>;
        let pick = any::<u8>;
        let job = || 0u8..4;
        let mut arms: Vec<(u32, BoxedStrategy<Op>)> = vec![
            (
                if state.workers == 0 { 10 } else { 2 },
                Just(Op::SpawnWorker).boxed(),
            ),
            (
                5,
                (w(), job(), size())
                    .prop_map(|(worker, job, size)| Op::LendNew { worker, job, size })
                    .boxed(),
            ),
            (
                2,
                (w(), job(), pick())
                    .prop_map(|(worker, job, pick)| Op::LendAgain { worker, job, pick })
                    .boxed(),
            ),
            (2, pick().prop_map(|pick| Op::DropTensor { pick }).boxed()),
            (
                3,
                (w(), job(), size())
                    .prop_map(|(worker, job, size)| Op::RequestResult { worker, job, size })
                    .boxed(),
            ),
            (
                3,
                (pick(), size())
                    .prop_map(|(pick, size)| Op::AllocateResult { pick, size })
                    .boxed(),
            ),
            (
                1,
                pick().prop_map(|pick| Op::DeclineResult { pick }).boxed(),
            ),
            (
                10,
                (w(), pick())
                    .prop_map(|(worker, pick)| Op::DeliverToWorker { worker, pick })
                    .boxed(),
            ),
            (
                10,
                (w(), pick())
                    .prop_map(|(worker, pick)| Op::DeliverToParent { worker, pick })
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
            (
                3,
                (w(), pick())
                    .prop_map(|(worker, pick)| Op::Access { worker, pick })
                    .boxed(),
            ),
            (
                6,
                (w(), pick())
                    .prop_map(|(worker, pick)| Op::Finish { worker, pick })
                    .boxed(),
            ),
            (
                1,
                (w(), job())
                    .prop_map(|(worker, job)| Op::Cancel { worker, job })
                    .boxed(),
            ),
            (
                2,
                (0u16..150)
                    .prop_map(|millis| Op::Advance { millis })
                    .boxed(),
            ),
            (2, Just(Op::Timeout).boxed()),
            (1, w().prop_map(|worker| Op::Crash { worker }).boxed()),
            (2, w().prop_map(|worker| Op::Reap { worker }).boxed()),
        ];
        if !state.shut_down {
            arms.push((1, Just(Op::Shutdown).boxed()));
        }
        Union::new_weighted(arms).boxed()
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

/// The system under test: the simulated world, with mutation `M` switched on
/// (`0` is none; `1..=8` break the invariant of that number, see [`mutation_for`]).
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
