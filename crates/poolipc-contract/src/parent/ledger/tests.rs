//! The ledger's own rules: its operations keep them, and each rule, broken by hand, is
//! reported by [`Ledger::check`] under its name and invariant.

use super::*;

const W: WorkerId = WorkerId(0);
const JOB: JobId = JobId(1);
const T: Timestamp = Timestamp(0);
const EVENT: EventBlob = EventBlob([1; 64]);

fn terms(alloc: u64, purpose: Purpose) -> Terms {
    Terms {
        alloc: AllocId(alloc),
        span: Span {
            ptr: alloc << 20,
            bytes: 4096,
        },
        rung: Rung::PoolPointer,
        purpose,
        read_only: true,
    }
}

fn allocated(alloc: u64) -> Answer {
    Answer::Allocated {
        alloc: AllocId(alloc),
        span: Span {
            ptr: alloc << 20,
            bytes: 4096,
        },
        rung: Rung::PoolPointer,
        pool: 0,
        export: ExportBlob([2; 64]),
        arena: None,
    }
}

/// One worker, one job with an input and a slice on loan, and a result request of two: the
/// first answered with an allocation, the second waiting.
fn busy() -> (Ledger, HandoffId, [RequestId; 2]) {
    let mut l = Ledger::default();
    l.add_worker(W);
    l.open_job(W, JOB, EVENT, T, T);
    let input = l.lend(W, JOB, terms(1, Purpose::Input));
    l.lend(W, JOB, terms(2, Purpose::Slice));
    let requests = l.open_batch(W, JOB, &[4096, 4096]);
    l.answer(requests[0], allocated(3));
    (l, input, [requests[0], requests[1]])
}

fn broken(l: &Ledger, rule: &str, invariant: Invariant) {
    let v = l.check().expect_err("the ledger is broken");
    assert_eq!(v.invariant, invariant, "{v}");
    assert!(v.detail.starts_with(&format!("ledger {rule}:")), "{v}");
}

#[test]
fn the_operations_keep_every_rule_from_lend_to_close() {
    let (mut l, input, [first, second]) = busy();
    l.check().expect("after lending and a first answer");
    l.answer(second, Answer::cancelled());
    l.check().expect("after the last answer");
    let answers = l.take_answered(W, JOB).expect("every request answered");
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[0].0, first);
    l.lend(W, JOB, terms(3, Purpose::Result { request: first }));
    l.check().expect("after the grant");
    if let Some(j) = l.job_mut(W, JOB) {
        j.done_seen = true;
    }
    l.mark_done(input, EVENT);
    l.check().expect("after DONE");
    for h in l.loans_of(W) {
        assert!(l.release(h).is_some());
    }
    assert!(l.close_job(W, JOB).is_some());
    l.check().expect("after the release");
    assert!(l.is_idle());
}

#[test]
fn a_reaped_workers_answered_requests_are_refused_and_its_loans_released() {
    let (mut l, _, [first, _]) = busy();
    assert!(l.condemn(W, FailReason::HungUp, "gone".into()));
    l.check().expect("a condemned worker keeps its loans");
    assert_eq!(l.reap(W), vec![JOB]);
    for h in l.loans_of(W) {
        assert!(l.release(h).is_some());
    }
    assert_eq!(l.refuse_answered(W, JOB), vec![(first, AllocId(3))]);
    l.check().expect("the job waits for its second answer");
}

#[test]
fn a_loan_missing_from_its_jobs_handoffs_breaks_l1() {
    let (mut l, input, _) = busy();
    if let Some(j) = l.jobs.get_mut(&(W, JOB)) {
        j.handoffs.retain(|h| *h != input);
    }
    broken(&l, "L1", Invariant::ReleaseAfterAckAndDone);
}

#[test]
fn a_live_workers_handoff_off_loan_breaks_l1() {
    let (mut l, input, _) = busy();
    l.loans.remove(&input);
    l.lent.remove(&AllocId(1));
    broken(&l, "L1", Invariant::ReleaseAfterAckAndDone);
}

#[test]
fn a_lent_count_off_by_one_breaks_l2() {
    let (mut l, _, _) = busy();
    if let Some(entry) = l.lent.get_mut(&AllocId(1)) {
        entry.1 += 1;
    }
    broken(&l, "L2", Invariant::ParentOwnsAllocations);
}

#[test]
fn an_unoffered_allocation_no_answer_holds_breaks_l3() {
    let (mut l, _, _) = busy();
    l.unoffered.insert(AllocId(9));
    broken(&l, "L3", Invariant::ParentOwnsAllocations);
}

#[test]
fn a_waiting_request_whose_slot_is_filled_breaks_l4() {
    let (mut l, _, [first, _]) = busy();
    if let Some(p) = l.requests.get(&RequestId(first.0 + 1)).cloned() {
        l.requests.insert(first, Pending { index: 0, ..p });
    }
    broken(&l, "L4", Invariant::ParentOwnsAllocations);
}

#[test]
fn a_job_its_worker_does_not_list_breaks_l5() {
    let (mut l, _, _) = busy();
    if let Some(peer) = l.workers.get_mut(&W) {
        peer.jobs.clear();
    }
    broken(&l, "L5", Invariant::DeathFailsOnlyItsJobs);
}

#[test]
fn a_reaped_worker_still_holding_a_loan_breaks_l5() {
    let (mut l, _, _) = busy();
    l.condemn(W, FailReason::HungUp, "gone".into());
    l.reap(W);
    broken(&l, "L5", Invariant::DeathFailsOnlyItsJobs);
}

#[test]
fn a_loan_done_before_its_jobs_done_breaks_l6() {
    let (mut l, input, _) = busy();
    l.mark_done(input, EVENT);
    broken(&l, "L6", Invariant::ReleaseAfterAckAndDone);
}

#[test]
fn a_handoff_id_past_the_next_fresh_one_breaks_l7() {
    let (mut l, _, _) = busy();
    l.next_handoff = 1;
    broken(&l, "L7", Invariant::ReleaseAfterAckAndDone);
}
