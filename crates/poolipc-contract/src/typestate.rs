//! Typestate handles for the facade: one value per handoff whose methods consume `self`, so
//! a step can only follow the step before it. What the compiler cannot see (messages from
//! another process, deadlines, deaths) the state machines check at run time.
//!
//! The parent's side of one handoff:
//!
//! ```
//! use poolipc_contract::typestate::{Loan, WorkerReaped};
//! use poolipc_contract::{AllocId, HandoffId, WorkerId};
//!
//! let loan = Loan::lent(HandoffId(7), AllocId(3));          // in a Lend or a grant, exported
//! let loan = loan.ready_recorded_and_sent();                // READY recorded, message sent
//! let loan = loan.acknowledged(HandoffId(7)).ok().unwrap(); // the job's ACK names it
//! let loan = loan.streams_wait_on_done();                   // the job's stream waits on DONE
//! let released = loan.release();                            // RELEASE
//! assert_eq!(released.handoff(), HandoffId(7));
//! ```
//!
//! Releasing before the ACK does not compile:
//!
//! ```compile_fail,E0599
//! use poolipc_contract::typestate::Loan;
//! use poolipc_contract::{AllocId, HandoffId};
//!
//! let loan = Loan::lent(HandoffId(7), AllocId(3)).ready_recorded_and_sent();
//! let released = loan.release(); // no `release` on a sent loan
//! ```
//!
//! Nor does releasing on the ACK without waiting on DONE:
//!
//! ```compile_fail,E0599
//! use poolipc_contract::typestate::Loan;
//! use poolipc_contract::{AllocId, HandoffId};
//!
//! let loan = Loan::lent(HandoffId(7), AllocId(3)).ready_recorded_and_sent();
//! let acked = loan.acknowledged(HandoffId(7)).ok().unwrap();
//! let released = acked.release(); // the gate is DONE on the GPU, not the ACK on the CPU
//! ```
//!
//! The worker's side of one handoff, in [`crate::Worker::finish_job`]'s order:
//!
//! ```
//! use poolipc_contract::typestate::Import;
//! use poolipc_contract::{AllocId, HandoffId};
//!
//! let import = Import::imported(HandoffId(7), AllocId(3)); // IMPORT (or a dedupe reference)
//! let ready = import.wait_ready();                         // stream waits on READY
//! let _memory = ready.access();                            // WRITE / read
//! let unimported = ready.unimport();                       // UNIMPORT after the last access
//! let done = unimported.record_done();                     // DONE covers the frees
//! assert_eq!(done.ack(), HandoffId(7));                    // named in the job's ACK
//! ```
//!
//! Touching (writing) the memory before READY does not compile:
//!
//! ```compile_fail,E0599
//! use poolipc_contract::typestate::Import;
//! use poolipc_contract::{AllocId, HandoffId};
//!
//! let import = Import::imported(HandoffId(7), AllocId(3));
//! let memory = import.access(); // no `access` before `wait_ready`
//! ```
//!
//! Recording DONE before the frees does not compile:
//!
//! ```compile_fail,E0599
//! use poolipc_contract::typestate::Import;
//! use poolipc_contract::{AllocId, HandoffId};
//!
//! let ready = Import::imported(HandoffId(7), AllocId(3)).wait_ready();
//! let done = ready.record_done(); // no `record_done` before `unimport`
//! ```
//!
//! ACK before DONE does not compile:
//!
//! ```compile_fail,E0599
//! use poolipc_contract::typestate::Import;
//! use poolipc_contract::{AllocId, HandoffId};
//!
//! let unimported = Import::imported(HandoffId(7), AllocId(3)).wait_ready().unimport();
//! let ack = unimported.ack(); // no `ack` before `record_done`
//! ```
//!
//! Nor does touching the memory after the free, since `unimport` consumed the ready handle:
//!
//! ```compile_fail,E0382
//! use poolipc_contract::typestate::Import;
//! use poolipc_contract::{AllocId, HandoffId};
//!
//! let ready = Import::imported(HandoffId(7), AllocId(3)).wait_ready();
//! let unimported = ready.unimport();
//! let memory = ready.access(); // `ready` was moved
//! ```

use std::marker::PhantomData;

use crate::types::{AllocId, HandoffId, WorkerId};

/// The states a handle moves through. Zero-sized markers.
pub mod state {
    /// Parent: the handoff is in a `Lend` or `AllocationGrant` about to be sent.
    #[derive(Debug)]
    pub struct Lent;
    /// Parent: READY is recorded and the message sent.
    #[derive(Debug)]
    pub struct Sent;
    /// Parent: the worker's ACK arrived.
    #[derive(Debug)]
    pub struct Acknowledged;
    /// Parent: the consumer streams wait on DONE.
    #[derive(Debug)]
    pub struct DoneAwaited;
    /// Worker: the allocation is imported (or a dedupe reference is taken).
    #[derive(Debug)]
    pub struct Imported;
    /// Worker: the stream waits on READY; the memory may be used.
    #[derive(Debug)]
    pub struct Ready;
    /// Worker: the import reference is dropped after the last access.
    #[derive(Debug)]
    pub struct Unimported;
    /// Worker: DONE is recorded after the frees.
    #[derive(Debug)]
    pub struct DoneRecorded;
}

/// The parent's handle on one handoff.
#[derive(Debug)]
#[must_use = "a loan must end in release"]
pub struct Loan<S> {
    handoff: HandoffId,
    alloc: AllocId,
    _state: PhantomData<S>,
}

impl<S> Loan<S> {
    /// The handoff.
    pub fn handoff(&self) -> HandoffId {
        self.handoff
    }

    /// The allocation.
    pub fn alloc(&self) -> AllocId {
        self.alloc
    }

    fn to<T>(self) -> Loan<T> {
        Loan {
            handoff: self.handoff,
            alloc: self.alloc,
            _state: PhantomData,
        }
    }
}

impl Loan<state::Lent> {
    /// A handoff of [`crate::Parent::start_job`] or of an allocation grant.
    pub fn lent(handoff: HandoffId, alloc: AllocId) -> Loan<state::Lent> {
        Loan {
            handoff,
            alloc,
            _state: PhantomData,
        }
    }

    /// After [`crate::ParentAction::RecordReady`] and the [`crate::ParentAction::Send`] of
    /// the message carrying it.
    pub fn ready_recorded_and_sent(self) -> Loan<state::Sent> {
        self.to()
    }
}

impl Loan<state::Sent> {
    /// The worker's ACK named `handoff`. Gives the loan back if it is another one.
    ///
    /// # Errors
    /// The loan itself, unchanged, when `handoff` is not this loan's.
    pub fn acknowledged(
        self,
        handoff: HandoffId,
    ) -> Result<Loan<state::Acknowledged>, Loan<state::Sent>> {
        if handoff == self.handoff {
            Ok(self.to())
        } else {
            Err(self)
        }
    }

    /// The worker that held it was reaped: the driver dropped its imports; release.
    pub fn worker_reaped(self, _proof: &WorkerReaped) -> Released {
        Released {
            handoff: self.handoff,
            alloc: self.alloc,
        }
    }
}

impl Loan<state::Acknowledged> {
    /// After [`crate::ParentAction::WaitDone`]: the job's stream waits on DONE.
    pub fn streams_wait_on_done(self) -> Loan<state::DoneAwaited> {
        self.to()
    }
}

impl Loan<state::DoneAwaited> {
    /// [`crate::ParentAction::Release`]: drop the reference; the allocator may reuse the
    /// memory once nothing else holds it.
    pub fn release(self) -> Released {
        Released {
            handoff: self.handoff,
            alloc: self.alloc,
        }
    }
}

/// Proof that a worker process was reaped (`waitpid` returned for it). Only the code that
/// reaps should make one.
#[derive(Debug)]
pub struct WorkerReaped {
    worker: WorkerId,
}

impl WorkerReaped {
    /// `worker` was reaped.
    #[must_use]
    pub fn new(worker: WorkerId) -> WorkerReaped {
        WorkerReaped { worker }
    }

    /// The worker.
    #[must_use]
    pub fn worker(&self) -> WorkerId {
        self.worker
    }
}

/// A finished loan.
#[derive(Debug)]
pub struct Released {
    handoff: HandoffId,
    alloc: AllocId,
}

impl Released {
    /// The handoff.
    #[must_use]
    pub fn handoff(&self) -> HandoffId {
        self.handoff
    }

    /// The allocation, which the parent may now reuse once nothing else holds it.
    #[must_use]
    pub fn alloc(&self) -> AllocId {
        self.alloc
    }
}

/// The worker's handle on one handoff.
#[derive(Debug)]
#[must_use = "an import must end in an ACK"]
pub struct Import<S> {
    handoff: HandoffId,
    alloc: AllocId,
    _state: PhantomData<S>,
}

impl<S> Import<S> {
    /// The handoff.
    pub fn handoff(&self) -> HandoffId {
        self.handoff
    }

    /// The allocation.
    pub fn alloc(&self) -> AllocId {
        self.alloc
    }

    fn to<T>(self) -> Import<T> {
        Import {
            handoff: self.handoff,
            alloc: self.alloc,
            _state: PhantomData,
        }
    }
}

impl Import<state::Imported> {
    /// After [`crate::WorkerAction::Import`] (or a dedupe reference on an import held).
    pub fn imported(handoff: HandoffId, alloc: AllocId) -> Import<state::Imported> {
        Import {
            handoff,
            alloc,
            _state: PhantomData,
        }
    }

    /// After [`crate::WorkerAction::WaitReady`]: the stream waits on READY.
    pub fn wait_ready(self) -> Import<state::Ready> {
        self.to()
    }
}

/// Leave to use the memory of a handoff on the worker's stream.
#[derive(Debug)]
pub struct Access<'a> {
    import: &'a Import<state::Ready>,
}

impl Access<'_> {
    /// The handoff.
    #[must_use]
    pub fn handoff(&self) -> HandoffId {
        self.import.handoff
    }
}

impl Import<state::Ready> {
    /// The memory may be read or written on the worker's stream while this borrow lives.
    #[must_use]
    pub fn access(&self) -> Access<'_> {
        Access { import: self }
    }

    /// After the last access: the import reference is dropped ([`crate::WorkerAction::Unimport`]
    /// when it was the last, stream ordered).
    pub fn unimport(self) -> Import<state::Unimported> {
        self.to()
    }
}

impl Import<state::Unimported> {
    /// [`crate::WorkerAction::RecordDone`], after the frees.
    pub fn record_done(self) -> Import<state::DoneRecorded> {
        self.to()
    }
}

impl Import<state::DoneRecorded> {
    /// The handle to name in the job's `Done` and `Ack`.
    #[must_use]
    pub fn ack(self) -> HandoffId {
        self.handoff
    }
}
