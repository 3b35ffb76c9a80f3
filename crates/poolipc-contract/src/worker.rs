//! The worker's side of the contract: imports each allocation once (refcounted), waits on
//! READY before use, and on finishing records DONE, unimports, then ACKs.

use std::collections::{BTreeMap, VecDeque};

use crate::error::ContractError;
use crate::legacy::{Offer, Refusal, ToParent, ToWorker};
use crate::types::{AllocId, HandoffId, JobId, Purpose, RequestId, ResultSpec, Span, Timestamp};

/// Something from outside for the worker machine.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkerEvent {
    /// A message from the parent.
    Message(ToWorker),
}

/// Work the worker machine asks of the worker's facade, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[must_use]
pub enum WorkerAction {
    /// Import the allocation's pointer from the offer's export blob. Only for the first
    /// handoff of an allocation this worker does not hold yet
    /// ([`crate::Invariant::OneImportPerAllocation`]).
    Import {
        /// The handoff that brought it.
        handoff: HandoffId,
        /// The allocation.
        alloc: AllocId,
        /// Its range.
        span: Span,
    },
    /// Make the worker's stream wait on the handoff's READY event.
    WaitReady {
        /// The handoff.
        handoff: HandoffId,
    },
    /// The memory may now be used on the worker's stream: read an input, write a result.
    /// When the last access is queued, call [`Worker::finish`].
    Usable {
        /// The handoff.
        handoff: HandoffId,
        /// Its job.
        job: JobId,
        /// The allocation (imported once per worker).
        alloc: AllocId,
        /// Input or result.
        purpose: Purpose,
    },
    /// Record the handoff's DONE event on the worker's stream, after its last access.
    RecordDone {
        /// The handoff.
        handoff: HandoffId,
    },
    /// Free the import of the allocation: no handoff of this worker uses it any more.
    Unimport {
        /// The allocation.
        alloc: AllocId,
    },
    /// Send a message to the parent.
    Send(ToParent),
    /// The parent refused a result request.
    ResultRefused {
        /// The job.
        job: JobId,
        /// The request.
        request: RequestId,
        /// Why.
        reason: Refusal,
    },
    /// The parent cancelled the job: stop, and finish every handoff of it.
    Cancelled {
        /// The job.
        job: JobId,
    },
    /// The parent is shutting down: finish what is held, take no new work.
    ShutdownRequested,
}

#[derive(Clone, Copy, Debug)]
struct Held {
    alloc: AllocId,
}

/// The worker's side of the ownership contract.
///
/// Sans-IO: [`Worker::handle`] takes the parent's messages, [`Worker::request_result`] and
/// [`Worker::finish`] the facade's decisions; [`Worker::poll_action`] gives what to do.
#[derive(Debug, Default)]
pub struct Worker {
    imports: BTreeMap<AllocId, u32>,
    held: BTreeMap<HandoffId, Held>,
    pending: BTreeMap<RequestId, JobId>,
    last_request: Option<RequestId>,
    newest_offer: Option<HandoffId>,
    shutting_down: bool,
    actions: VecDeque<WorkerAction>,
    #[cfg(test)]
    pub(crate) mutation: Option<crate::mutation::Mutation>,
}

impl Worker {
    /// A worker holding nothing.
    #[must_use]
    pub fn new() -> Worker {
        Worker::default()
    }

    #[cfg(test)]
    pub(crate) fn with_mutation(mutation: Option<crate::mutation::Mutation>) -> Worker {
        Worker {
            mutation,
            ..Worker::default()
        }
    }

    #[cfg(test)]
    fn mutated(&self, m: crate::mutation::Mutation) -> bool {
        self.mutation == Some(m)
    }

    #[cfg(not(test))]
    #[allow(clippy::unused_self)] // the test build reads `self`
    fn mutated(&self, _: crate::mutation::Mutation) -> bool {
        false
    }

    /// The next action to carry out, if any.
    pub fn poll_action(&mut self) -> Option<WorkerAction> {
        self.actions.pop_front()
    }

    /// Handoffs held (usable, not finished).
    #[must_use]
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Live driver imports, and the handoffs counted on each.
    pub fn imports(&self) -> impl Iterator<Item = (AllocId, u32)> + '_ {
        self.imports.iter().map(|(a, n)| (*a, *n))
    }

    /// A message from the parent.
    ///
    /// # Errors
    /// A stale (duplicated or reordered) offer, an offer or refusal for a request not
    /// pending. Nothing is imported then.
    pub fn handle(&mut self, event: WorkerEvent, _now: Timestamp) -> Result<(), ContractError> {
        match event {
            WorkerEvent::Message(ToWorker::Offer(offer)) => self.on_offer(offer),
            WorkerEvent::Message(ToWorker::ResultRefused {
                job,
                request,
                reason,
            }) => {
                if self.pending.get(&request) != Some(&job) {
                    return Err(ContractError::UnknownRequest { request });
                }
                self.pending.remove(&request);
                self.actions.push_back(WorkerAction::ResultRefused {
                    job,
                    request,
                    reason,
                });
                Ok(())
            }
            WorkerEvent::Message(ToWorker::Cancel { job }) => {
                self.actions.push_back(WorkerAction::Cancelled { job });
                Ok(())
            }
            WorkerEvent::Message(ToWorker::Shutdown) => {
                if !self.shutting_down {
                    self.shutting_down = true;
                    self.actions.push_back(WorkerAction::ShutdownRequested);
                }
                Ok(())
            }
        }
    }

    fn on_offer(&mut self, offer: Offer) -> Result<(), ContractError> {
        let Offer {
            handoff,
            job,
            alloc,
            span,
            purpose,
        } = offer;
        if self.newest_offer.is_some_and(|newest| handoff <= newest) {
            return Err(ContractError::StaleOffer(handoff));
        }
        if let Purpose::Result { request } = purpose {
            if self.pending.get(&request) != Some(&job) {
                return Err(ContractError::UnknownRequest { request });
            }
            self.pending.remove(&request);
        }
        self.newest_offer = Some(handoff);
        let always_import = self.mutated(crate::mutation::Mutation::ImportEveryOffer);
        let refs = self.imports.entry(alloc).or_insert(0);
        if *refs == 0 || always_import {
            self.actions.push_back(WorkerAction::Import {
                handoff,
                alloc,
                span,
            });
        }
        *refs += 1;
        if !self.mutated(crate::mutation::Mutation::UseBeforeReady) {
            self.actions.push_back(WorkerAction::WaitReady { handoff });
        }
        self.held.insert(handoff, Held { alloc });
        self.actions.push_back(WorkerAction::Usable {
            handoff,
            job,
            alloc,
            purpose,
        });
        Ok(())
    }

    /// Ask the parent for result memory, shape first.
    ///
    /// # Errors
    /// [`ContractError::ShuttingDown`] after the parent's shutdown request;
    /// [`ContractError::DuplicateRequest`] if `request` is not newer than the last one.
    pub fn request_result(
        &mut self,
        job: JobId,
        request: RequestId,
        spec: ResultSpec,
    ) -> Result<(), ContractError> {
        if self.shutting_down {
            return Err(ContractError::ShuttingDown);
        }
        if self.last_request.is_some_and(|last| request <= last) {
            return Err(ContractError::DuplicateRequest { request });
        }
        self.last_request = Some(request);
        self.pending.insert(request, job);
        self.actions
            .push_back(WorkerAction::Send(ToParent::ResultRequest {
                job,
                request,
                spec,
            }));
        Ok(())
    }

    /// The last access to the handoff's memory is queued: record DONE, drop the import
    /// reference (unimport if it was the last), ACK.
    ///
    /// # Errors
    /// [`ContractError::UnknownHandoff`] if the handoff is not held.
    pub fn finish(&mut self, handoff: HandoffId) -> Result<(), ContractError> {
        let Some(Held { alloc }) = self.held.remove(&handoff) else {
            return Err(ContractError::UnknownHandoff(handoff));
        };
        self.actions.push_back(WorkerAction::RecordDone { handoff });
        let ack = WorkerAction::Send(ToParent::Ack { handoff });
        let ack_first = self.mutated(crate::mutation::Mutation::AckBeforeUnimport);
        if ack_first {
            self.actions.push_back(ack.clone());
        }
        let last = match self.imports.get_mut(&alloc) {
            Some(refs) => {
                *refs = refs.saturating_sub(1);
                *refs == 0
            }
            None => false,
        };
        if last {
            self.imports.remove(&alloc);
            self.actions.push_back(WorkerAction::Unimport { alloc });
        }
        if !ack_first {
            self.actions.push_back(ack);
        }
        Ok(())
    }
}
