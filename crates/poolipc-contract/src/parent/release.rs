//! The end of a job: the worker's `Done` (its handles checked, its slice's carves checked,
//! staged bytes pulled back), its `Ack` (every handoff named, each DONE), and the release of
//! each handoff, after the stream waited on DONE where the rung needs it.

use std::collections::BTreeSet;

use crate::message::{Ack, CarvedResult, Done};
use crate::mutation::Mutation;
use crate::types::{
    HandoffId, JobId, Outcome, Purpose, Rung, Timestamp, WorkerId, dense_bytes, done_gated, staged,
};
use poolipc_types::ARENA_ALIGN;

use super::{FailReason, JobOutcome, Parent, ParentAction};

impl Parent {
    pub(super) fn on_done(&mut self, worker: WorkerId, done: Done, now: Timestamp) {
        let Done {
            job,
            done_event,
            handles,
            carved,
        } = done;
        let Some(j) = self.ledger.job(worker, job) else {
            return self.violation(worker, format!("a Done for {job}, which is not open"));
        };
        let slice = j.slice();
        let mut seen = BTreeSet::new();
        for h in &handles {
            if let Err(fault) = self.check_handle(worker, job, *h) {
                return self.violation(worker, format!("the Done for {job} names {fault}"));
            }
            if self.ledger.loan(*h).is_some_and(|l| l.done.is_some()) || !seen.insert(*h) {
                return self.violation(
                    worker,
                    format!("the Done for {job} names {h}, which is DONE already"),
                );
            }
        }
        if !carved.is_empty() {
            let granted = self
                .ledger
                .loans()
                .filter(|(_, l)| {
                    l.worker == worker
                        && l.job == job
                        && matches!(l.purpose, Purpose::Result { .. })
                })
                .count();
            let checked = match slice {
                None => Err("carves, but the job has no slice".to_owned()),
                Some((handle, _)) if !seen.contains(&handle) => {
                    Err(format!("carves, but not its slice {handle}"))
                }
                Some((_, bytes)) => check_carves(&carved, bytes, granted),
            };
            if let Err(fault) = checked {
                return self.violation(worker, format!("the Done for {job} names {fault}"));
            }
            if let Some((handle, _)) = slice {
                self.ledger.set_carves(handle, carved);
            }
        }
        let first = self.ledger.job(worker, job).is_some_and(|j| !j.done_seen);
        if let Some(j) = self.ledger.job_mut(worker, job) {
            j.done_seen = true;
        }
        if first || !handles.is_empty() {
            self.progress(worker, job, now);
        } else {
            self.idle(worker, job, "a Done that named no handoff");
        }
        for h in handles {
            self.ledger.mark_done(h, done_event);
            let Some(loan) = self.ledger.loan(h) else {
                continue;
            };
            // A staged result's bytes, and a writable staged input's (copy-back), follow.
            let comes_back = match loan.purpose {
                Purpose::Result { .. } => true,
                Purpose::Input => !loan.read_only,
                Purpose::Slice => false,
            };
            if comes_back && staged(loan.rung) {
                self.actions.push_back(ParentAction::ReceiveStaged {
                    worker,
                    job,
                    handoff: h,
                });
            }
        }
    }

    /// Whether `h` is an open handoff of `worker` and `job`; if not, what it is.
    fn check_handle(&self, worker: WorkerId, job: JobId, h: HandoffId) -> Result<(), String> {
        match self.ledger.loan(h) {
            None => Err(format!("{h}, which is not an open handoff")),
            Some(l) if l.worker != worker => Err(format!("{h}, which is another worker's")),
            Some(l) if l.job != job => Err(format!("{h}, which belongs to {}", l.job)),
            Some(_) => Ok(()),
        }
    }

    pub(super) fn on_ack(&mut self, worker: WorkerId, ack: Ack) {
        let Ack { job, handles } = ack;
        let Some(j) = self.ledger.job(worker, job) else {
            return self.violation(worker, format!("an Ack for {job}, which is not open"));
        };
        if !j.done_seen {
            return self.violation(worker, format!("an Ack for {job} before its Done"));
        }
        if j.batch().is_some() {
            return self.violation(
                worker,
                format!("an Ack for {job} while its result request is not answered"),
            );
        }
        let mut seen = BTreeSet::new();
        for h in &handles {
            if let Err(fault) = self.check_handle(worker, job, *h) {
                return self.violation(worker, format!("the Ack for {job} names {fault}"));
            }
            if !seen.insert(*h) {
                return self.violation(worker, format!("the Ack for {job} names {h} twice"));
            }
            if self.ledger.loan(*h).is_some_and(|l| l.done.is_none()) {
                return self.violation(
                    worker,
                    format!("the Ack for {job} names {h}, which is not DONE"),
                );
            }
        }
        if let Some(open) = j.handoffs().iter().find(|h| !seen.contains(h)) {
            return self.violation(worker, format!("the Ack for {job} leaves {open} open"));
        }
        let Some(j) = self.ledger.close_job(worker, job) else {
            return;
        };
        let outcome = if j.cancelled {
            Outcome::Cancelled
        } else {
            Outcome::Completed
        };
        for h in handles {
            let Some(loan) = self.ledger.loan(h) else {
                continue;
            };
            let tail_first =
                loan.purpose == Purpose::Slice && self.mutated(Mutation::ReturnSliceTailBeforeDone);
            if tail_first {
                // Test-only bug: the slice's unused tail (and the rest) goes back at the ACK,
                // before the stream waits on the worker's DONE.
                let done = loan.done;
                self.release(h, outcome);
                if let Some(done_event) = done {
                    self.actions.push_back(ParentAction::WaitDone {
                        worker,
                        job,
                        handoff: h,
                        done_event,
                    });
                }
                continue;
            }
            if done_gated(loan.rung)
                && let Some(done_event) = loan.done
                && !self.mutated(Mutation::ReleaseWithoutWaitingDone)
                && !(loan.rung == Rung::ArenaCopy
                    && self.mutated(Mutation::ReturnArenaCopyBeforeDone))
            {
                self.actions.push_back(ParentAction::WaitDone {
                    worker,
                    job,
                    handoff: h,
                    done_event,
                });
            }
            self.release(h, outcome);
        }
        let outcome = if j.cancelled {
            JobOutcome::Failed {
                reason: FailReason::Cancelled,
                detail: format!("{job} was cancelled"),
            }
        } else if let Some(message) = j.error {
            JobOutcome::WorkerError(message)
        } else {
            JobOutcome::Completed
        };
        self.actions.push_back(ParentAction::JobFinished {
            worker,
            job,
            outcome,
        });
    }

    /// Ends the loan of `handoff` and tells the facade: [`ParentAction::ReleaseSlice`] for
    /// a slice (its carves only on [`Outcome::Completed`]), [`ParentAction::Release`] for
    /// anything else.
    pub(super) fn release(&mut self, handoff: HandoffId, outcome: Outcome) {
        let Some(loan) = self.ledger.release(handoff) else {
            return;
        };
        if loan.purpose == Purpose::Slice {
            self.actions.push_back(ParentAction::ReleaseSlice {
                worker: loan.worker,
                job: loan.job,
                handoff,
                alloc: loan.alloc,
                outcome,
                carved: if outcome == Outcome::Completed {
                    loan.carved
                } else {
                    Vec::new()
                },
            });
            return;
        }
        self.actions.push_back(ParentAction::Release {
            worker: loan.worker,
            job: loan.job,
            handoff,
            alloc: loan.alloc,
            purpose: loan.purpose,
            rung: loan.rung,
            outcome,
        });
    }
}

/// Checks a worker's carves out of a slice of `slice_bytes`, for a job with `granted` granted
/// results: each non-empty, the dense size of its shape, at an offset aligned to
/// [`ARENA_ALIGN`], inside the slice, overlapping no other, at a place among the job's
/// results that is in range and not taken. Returns what is wrong, for the violation.
fn check_carves(carved: &[CarvedResult], slice_bytes: u64, granted: usize) -> Result<(), String> {
    let places = carved.len().saturating_add(granted);
    let mut taken = BTreeSet::new();
    let mut ranges = Vec::with_capacity(carved.len());
    for (i, c) in carved.iter().enumerate() {
        match dense_bytes(c.dtype, &c.shape) {
            Some(dense) if dense == c.bytes => {}
            Some(dense) => {
                return Err(format!(
                    "carve {i} of {} bytes, but {:?} of {:?} takes {dense}",
                    c.bytes, c.shape, c.dtype
                ));
            }
            None => {
                return Err(format!(
                    "carve {i}: the size of {:?} of {:?} overflows",
                    c.shape, c.dtype
                ));
            }
        }
        if c.bytes == 0 {
            return Err(format!(
                "carve {i} of 0 bytes (an empty result needs no memory)"
            ));
        }
        if !c.offset.is_multiple_of(ARENA_ALIGN) {
            return Err(format!(
                "carve {i} at offset {}, not a multiple of {ARENA_ALIGN}",
                c.offset
            ));
        }
        let end = c.offset.checked_add(c.bytes).filter(|e| *e <= slice_bytes);
        let Some(end) = end else {
            return Err(format!(
                "carve {i} of {} bytes at offset {}, past the slice's {slice_bytes} bytes",
                c.bytes, c.offset
            ));
        };
        if usize::try_from(c.index).map_or(true, |x| x >= places) {
            return Err(format!(
                "carve {i} at place {} among {places} results",
                c.index
            ));
        }
        if !taken.insert(c.index) {
            return Err(format!("carve {i} at place {}, which is taken", c.index));
        }
        ranges.push((c.offset, end, i));
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if let [(_, end, a), (start, _, b)] = pair
            && start < end
        {
            return Err(format!("carves {a} and {b}, which overlap"));
        }
    }
    Ok(())
}
