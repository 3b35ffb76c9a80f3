//! Callers' result allocators, run off the IO thread. A job submitted with its own allocator
//! ([`Parent::submit_with`](crate::Parent::submit_with); in Python every torch job, whose
//! results `torch.empty` makes) has each of its results made by that allocator, which may
//! take its time: a Python allocator waits for the GIL (up to the interpreter's switch
//! interval, 5 ms, behind any busy Python thread), torch may free its cache to find room.
//! On the IO thread that wait would stall every worker of the room; here it stalls only the
//! job whose result it is. Each room has one allocator thread, started at its first call:
//! the calls of one job are made in the order the worker asked for them, and each answer
//! comes back to the room as [`Command::ResultMade`], where the
//! loop goes on as it did when it made the memory itself.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use poolipc_contract::ResultSpec;
use poolipc_driver::{DevicePtr, StreamHandle};
use poolipc_types::{JobId, RequestId, WorkerId};

use super::Shared;
use super::{Command, Loop};
use crate::error::Error;
use crate::state::ResultAllocator;
use crate::tensor::ResultShape;

/// A job's allocator, shared between the job (on the IO thread) and the allocator thread.
pub(super) type SharedAllocator = Arc<Mutex<ResultAllocator>>;

/// One result for the allocator thread to make.
pub(super) struct AllocCall {
    worker: WorkerId,
    job: JobId,
    request: RequestId,
    spec: ResultSpec,
    stream: StreamHandle,
    alloc: SharedAllocator,
}

/// What a caller's allocator made (or why not), back on the IO thread.
pub(crate) struct AllocMade {
    worker: WorkerId,
    job: JobId,
    request: RequestId,
    spec: ResultSpec,
    made: Result<DevicePtr, Error>,
}

impl AllocMade {
    /// The worker whose job's result this is (it decides the room).
    pub(crate) fn worker(&self) -> WorkerId {
        self.worker
    }
}

/// The allocator thread's body: each call in turn, answered to the room.
fn serve(shared: &Shared, calls: &Receiver<AllocCall>) {
    // The caller's allocator may allocate through the driver (a pool's memory): it needs the
    // device's context, as every CUDA thread does.
    if let Err(e) = shared.driver.use_device(shared.options.device) {
        tracing::warn!(error = %e, "the result allocator thread could not make the device current");
    }
    while let Ok(call) = calls.recv() {
        let AllocCall {
            worker,
            job,
            request,
            spec,
            stream,
            alloc,
        } = call;
        let shape = ResultShape {
            dtype: spec.dtype,
            shape: spec.shape.clone(),
        };
        crate::probe::mark("alloc.call");
        let made = match alloc.lock() {
            Ok(mut f) => {
                std::panic::catch_unwind(AssertUnwindSafe(|| (*f)(&shape, spec.byte_len, stream)))
                    .unwrap_or_else(|_| {
                        Err(Error::ResultRefused(
                            "the job's result allocator panicked".into(),
                        ))
                    })
            }
            Err(_) => Err(Error::ResultRefused(
                "the job's result allocator panicked at an earlier result".into(),
            )),
        };
        // The room wakes for it; a room already gone drops it (the memory is the caller's).
        shared.post(Command::ResultMade(Box::new(AllocMade {
            worker,
            job,
            request,
            spec,
            made,
        })));
    }
}

impl Loop {
    /// Hands result `request` of `job` to the room's allocator thread (started now if it is
    /// not running); the answer comes back as [`Command::ResultMade`].
    pub(super) fn call_allocator(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        spec: &ResultSpec,
        stream: StreamHandle,
        alloc: SharedAllocator,
    ) {
        let call = AllocCall {
            worker,
            job,
            request,
            spec: spec.clone(),
            stream,
            alloc,
        };
        let call = match &self.allocator {
            Some(tx) => match tx.send(call) {
                Ok(()) => return,
                // The thread ended (it never does on its own): start another.
                Err(back) => back.0,
            },
            None => call,
        };
        let (tx, rx) = std::sync::mpsc::channel::<AllocCall>();
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name(format!("poolipc-alloc-{}", self.room))
            .spawn(move || serve(&shared, &rx));
        match spawned {
            Ok(_) => {
                // The thread holds the receiver: this send cannot fail while it runs.
                let _ = tx.send(call);
                self.allocator = Some(tx);
            }
            Err(e) => {
                let made = Err(Error::ResultRefused(format!(
                    "starting the result allocator thread failed: {e}"
                )));
                self.result_made(AllocMade {
                    worker,
                    job,
                    request,
                    spec: call.spec,
                    made,
                });
            }
        }
    }

    /// A caller's allocator answered: the result goes on as one the loop made (or is
    /// declined with the allocator's error).
    pub(super) fn result_made(&mut self, made: AllocMade) {
        let AllocMade {
            worker,
            job,
            request,
            spec,
            made,
        } = made;
        crate::probe::mark("io.result_made");
        if !self.jobs.contains_key(&(worker, job)) {
            // The job ended while its allocator ran (its worker was lost): the memory is the
            // caller's, as every result of a failed job is; it is in no job's error, so say so.
            if let Ok(ptr) = made {
                tracing::warn!(
                    worker = %worker,
                    job = job.0,
                    ptr = ptr.0,
                    "the job ended while its result allocator ran: the memory it made is the caller's to free"
                );
            }
            return;
        }
        self.answer_result(worker, job, request, &spec, Some(made));
        self.drive();
    }
}
