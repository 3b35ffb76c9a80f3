//! One job as the worker's code sees it: the views of its inputs and results, and the
//! obligation to finish it.

use std::sync::Arc;

use poolipc_driver::{DevicePtr, Driver, StreamHandle};
use poolipc_transport::{JobId, ResultGrant, ResultSpec};

use super::Worker;
use crate::error::Error;
use crate::tensor::{Layout, ResultShape, Rung};

/// An input of a job: readable on the job's stream, valid until the job finishes.
///
/// A write to it reaches the parent's tensor on every rung unless the parent lent it
/// read-only (its [`read_only`](InputView::read_only) field):
/// - [`Rung::PoolPointer`]: the view is the parent's own memory, imported; the parent sees a
///   write (ordered by the job's DONE event).
/// - [`Rung::ArenaCopy`]: the view is a copy the parent made for this job in a block of its
///   arena, read through this worker's mapping (no import); the parent copies the block back
///   after its wait on DONE. Lent read-only, the view is a read-only mapping of the block: a
///   write faults (a kernel) or fails (a copy) instead of vanishing.
/// - [`Rung::HostStaging`]: the view is this worker's private copy; its bytes go back to the
///   parent after the job's `Done`. Lent read-only, nothing goes back: the Python binding
///   marks the tensor read-only (DLPack's flag, `__cuda_array_interface__`'s `data[1]`) and
///   refuses `View.write_bytes`; Rust code must check the flag, since a kernel's write to
///   the private copy cannot be stopped and is dropped with the copy.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct InputView {
    /// The address of element 0 in this process.
    pub ptr: DevicePtr,
    /// The layout.
    pub desc: Layout,
    /// Bytes from element 0 to the end of the last element.
    pub byte_len: u64,
    /// How it crossed.
    pub rung: Rung,
    /// Whether the parent lent it read-only (the caller's
    /// [`Input::read_only`](crate::Input::read_only)): it must not be written, and nothing
    /// written would reach the parent. Otherwise a write reaches the parent's tensor on every
    /// rung (see above).
    pub read_only: bool,
}

/// A result buffer of a job, allocated by the parent: write it on the job's stream.
///
/// On [`Rung::PoolPointer`] it is the parent's allocation, imported; on [`Rung::Arena`] it
/// is a block of the parent's result arena, which this worker mapped once (no import, nothing
/// to free); on [`Rung::HostStaging`] it is memory of this worker whose bytes are sent to the
/// parent's allocation when the job finishes. Either way the parent sees what was written,
/// and the view must not be touched after the job finishes.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ResultView {
    /// The address in this process.
    pub ptr: DevicePtr,
    /// The shape asked for.
    pub shape: ResultShape,
    /// Its size.
    pub bytes: u64,
    /// How it crosses.
    pub rung: Rung,
}

/// One job: its inputs, the results asked for, and the obligation to finish it.
///
/// Views are valid until [`finish`](Job::finish) (or drop, which finishes too): the parent
/// may reuse the memory after that.
pub struct Job<'w> {
    pub(super) worker: &'w mut Worker,
    pub(super) id: JobId,
    pub(super) inputs: Vec<InputView>,
    pub(super) results: Vec<ResultView>,
    /// The job's arena slice, at its address here, when the parent lent one this worker can
    /// use: results are carved out of it before any request.
    pub(super) slice: Option<DevicePtr>,
    pub(super) finished: bool,
}

impl std::fmt::Debug for Job<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.id)
            .field("inputs", &self.inputs.len())
            .field("results", &self.results.len())
            .finish_non_exhaustive()
    }
}

impl Job<'_> {
    /// The job's id.
    pub fn id(&self) -> JobId {
        self.id
    }
    /// The inputs, in argument order. Their memory is ready on [`stream`](Job::stream).
    /// Host-staged ones are read-only ([`InputView::read_only`]).
    pub fn inputs(&self) -> &[InputView] {
        &self.inputs
    }
    /// The results requested so far (granted ones only).
    pub fn results(&self) -> &[ResultView] {
        &self.results
    }
    /// The stream to work on: it waited on READY; DONE is recorded on it.
    pub fn stream(&self) -> StreamHandle {
        self.worker.stream.handle()
    }
    /// The driver (the facade's own code; callers reach it through
    /// [`RawDriver`](crate::advanced::RawDriver)).
    pub(crate) fn driver_ref(&self) -> &Arc<dyn Driver> {
        &self.worker.driver
    }
    /// Whether the parent cancelled this job. Its further result requests are refused;
    /// finish it soon (its inputs stay valid until then).
    pub fn cancelled(&self) -> bool {
        self.worker.cancelled.contains(&self.id)
    }

    /// Asks the parent for result memory, shape first; returns the new result views, once
    /// the parent granted them and they are writable on [`stream`](Job::stream).
    ///
    /// When the parent lent the job an arena slice
    /// ([`ParentOptions::arena_slice_bytes`](crate::ParentOptions::arena_slice_bytes)) and
    /// every result asked for fits in what is left of it, they are carved out of it instead
    /// ([`Rung::Arena`] views, 512-byte aligned): no message, no wait. A batch that does not
    /// fit whole goes to the parent as usual, so results keep the order they were asked in.
    ///
    /// Lends of later jobs that arrive meanwhile are queued for
    /// [`Worker::next_job`]. If the parent refused any of the results, this returns
    /// [`Error::ResultRefused`]; the ones it granted are in [`results`](Job::results) all
    /// the same (and are sent back when the job finishes).
    pub fn request_results(&mut self, shapes: &[ResultShape]) -> Result<&[ResultView], Error> {
        if shapes.is_empty() {
            return Ok(&[]);
        }
        let specs = shapes
            .iter()
            .map(|s| {
                Ok(ResultSpec {
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    byte_len: s.bytes()?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let w = &mut *self.worker;
        let first = self.results.len();
        if let Some(base) = self.slice
            && let Some(offsets) = w.machine.carve_results(self.id, &specs)?
        {
            for ((shape, spec), offset) in shapes.iter().zip(&specs).zip(offsets) {
                self.results.push(ResultView {
                    ptr: base.offset(offset),
                    shape: shape.clone(),
                    bytes: spec.byte_len,
                    rung: Rung::Arena,
                });
            }
            tracing::trace!(
                job = self.id.0,
                count = specs.len(),
                "results carved out of the slice"
            );
            self.lend_results(first);
            return Ok(&self.results[first..]);
        }
        w.machine.request_results(self.id, specs.clone())?;
        w.drain()?;
        let grants = w.wait_for_grants(self.id)?;
        if grants.len() != specs.len() {
            return Err(Error::Protocol(format!(
                "{} grants for {} results of job {}",
                grants.len(),
                specs.len(),
                self.id.0
            )));
        }
        let mut refused = None;
        for (grant, (shape, spec)) in grants.into_iter().zip(shapes.iter().zip(&specs)) {
            match grant {
                ResultGrant::Granted {
                    handle,
                    alloc,
                    rung,
                    pool: _,
                    export: _,
                    ready_event: _,
                } => {
                    let ptr = w.result_memory(self.id, handle, alloc, rung, spec.byte_len)?;
                    self.results.push(ResultView {
                        ptr,
                        shape: shape.clone(),
                        bytes: spec.byte_len,
                        rung,
                    });
                }
                ResultGrant::Arena {
                    handle: _,
                    alloc: _,
                    chunk,
                    offset,
                    bytes,
                } => {
                    let ptr = w.arena_memory(chunk, offset, bytes, spec.byte_len)?;
                    self.results.push(ResultView {
                        ptr,
                        shape: shape.clone(),
                        bytes: spec.byte_len,
                        rung: Rung::Arena,
                    });
                }
                ResultGrant::Refused { code, message } => {
                    refused.get_or_insert(format!("{message} ({code})"));
                }
            }
        }
        if let Some(why) = refused {
            return Err(Error::ResultRefused(why));
        }
        self.lend_results(first);
        Ok(&self.results[first..])
    }

    /// On the simulated driver: results from `first` on are lent to this job (see
    /// [`crate::check`]).
    fn lend_results(&self, first: usize) {
        let w = &*self.worker;
        if w.sim.is_none() {
            return;
        }
        for (i, r) in self.results.iter().enumerate().skip(first) {
            w.driver.sim_lend(
                self.id.0,
                r.ptr,
                r.bytes,
                w.stream.handle(),
                false,
                &format!("result {i} of job {}", self.id.0),
            );
        }
    }

    /// Tells the parent this job is still being computed: progress that restarts its
    /// handoff deadline ([`ParentOptions::handoff_timeout`](crate::ParentOptions::handoff_timeout),
    /// 30 s by default), never past its lifetime
    /// ([`ParentOptions::max_job_lifetime`](crate::ParentOptions::max_job_lifetime)). Call it
    /// from a long computation (a sampler's steps, say) more often than the deadline: each
    /// call is one small frame, so once a second is plenty. Workers of this library declare
    /// long jobs at the handshake, which is what makes a parent count heartbeats as progress.
    pub fn heartbeat(&mut self) -> Result<(), Error> {
        let w = &mut *self.worker;
        w.machine.heartbeat(self.id)?;
        w.drain()
    }

    /// Reports a failure of the job to the parent (the job then ends with this message as
    /// its error), then finishes it: what it held is given back as usual.
    pub fn fail(mut self, message: &str) -> Result<(), Error> {
        let w = &mut *self.worker;
        w.machine.fail_job(self.id, message.to_owned())?;
        w.drain()?;
        self.finish_inner()
    }

    /// The work on every view is queued on [`stream`](Job::stream): free the imports
    /// (stream-ordered), record DONE after them, tell the parent (Done, the staged results'
    /// bytes, Ack), in the order the contract gives.
    ///
    /// DONE is recorded after the imports' frees, so the parent's wait on DONE covers them
    /// too: the importer's free is ordered before the exporter may reuse the memory. The
    /// worker does not synchronize: a synchronize would unmap the freed imports, making the
    /// next import of recycled memory cost 1 ms/GiB (measured on the H200).
    pub fn finish(mut self) -> Result<(), Error> {
        self.finish_inner()
    }

    fn finish_inner(&mut self) -> Result<(), Error> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        self.worker.finish_job(self.id)
    }
}

/// A job set aside with [`Job::hold`] so that the worker can take the next one while this
/// one stays open: what it holds (imports, staged copies, granted results) stays held, and
/// the parent keeps waiting for its DONE. Take it up again with [`Worker::resume`] to ask for
/// results, finish or fail it.
///
/// A worker can so hold several jobs at once and end them in any order (each has its own
/// Done and Ack; the parent matches them by job). The parent's handoff deadline runs for a
/// held job as for any other: one held longer than `ParentOptions::handoff_timeout` without
/// a word costs the worker its connection.
///
/// Dropped without being resumed and finished, it is not finished: the parent then sees a
/// silent job until its deadline. Finish what you hold.
#[derive(Debug)]
#[must_use = "a held job stays open until it is resumed and finished"]
pub struct HeldJob {
    id: JobId,
    inputs: Vec<InputView>,
    results: Vec<ResultView>,
    slice: Option<DevicePtr>,
}

impl HeldJob {
    /// The job's id.
    pub fn id(&self) -> JobId {
        self.id
    }
    /// The inputs, in argument order (as [`Job::inputs`]).
    pub fn inputs(&self) -> &[InputView] {
        &self.inputs
    }
    /// The results granted so far (as [`Job::results`]).
    pub fn results(&self) -> &[ResultView] {
        &self.results
    }
}

impl Job<'_> {
    /// Sets the job aside, still open, and gives the worker back: see [`HeldJob`].
    pub fn hold(mut self) -> HeldJob {
        // Not finished: the drop below must leave it open.
        self.finished = true;
        HeldJob {
            id: self.id,
            inputs: std::mem::take(&mut self.inputs),
            results: std::mem::take(&mut self.results),
            slice: self.slice,
        }
    }
}

impl Worker {
    /// Takes up a job set aside with [`Job::hold`].
    ///
    /// # Errors
    /// [`Error::Protocol`] when the job is not open on this worker (it was held by another
    /// worker, or the worker lost its parent meanwhile): the held job is dropped.
    pub fn resume(&mut self, held: HeldJob) -> Result<Job<'_>, Error> {
        if !self.machine.jobs().any(|j| j == held.id) {
            return Err(Error::Protocol(format!(
                "job {} is not open on this worker",
                held.id.0
            )));
        }
        Ok(Job {
            worker: self,
            id: held.id,
            inputs: held.inputs,
            results: held.results,
            slice: held.slice,
            finished: false,
        })
    }
}

impl Drop for Job<'_> {
    /// A job dropped without [`finish`](Job::finish) or [`fail`](Job::fail) (the worker's
    /// code returned early with an error, or panicked) is reported as failed, then finished:
    /// what it held is given back as usual, and the parent's caller gets an error instead of
    /// a job that seems to have succeeded with results missing.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let why = if std::thread::panicking() {
            "the worker's code panicked during the job"
        } else {
            "the worker's code dropped the job without finishing it (it returned early, most \
             likely with an error)"
        };
        let w = &mut *self.worker;
        if let Err(e) = w
            .machine
            .fail_job(self.id, why.to_owned())
            .map_err(Error::from)
            .and_then(|()| w.drain())
        {
            tracing::warn!(job = self.id.0, error = %e, "reporting a dropped job failed");
        }
        if let Err(e) = self.finish_inner() {
            tracing::warn!(job = self.id.0, error = %e, "finishing a dropped job failed");
        }
    }
}
