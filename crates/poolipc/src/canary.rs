//! The canary battery: before a worker takes jobs, the parent proves the whole contract on it
//! with real transfers, and demotes the worker to the next rung if anything fails.
//!
//! The worker side answers canary jobs inside [`Worker::next_job`](crate::Worker::next_job)
//! with the echo worker's behaviour, so user code never sees them.

use poolipc_driver::{DevicePtr, StreamHandle};
use poolipc_transport::{DType, JobId};

use crate::echo;
use crate::error::Error;
use crate::parent::{Input, Parent};
use crate::tensor::TensorDesc;

/// Job ids with this bit set are canary jobs.
pub const CANARY_BIT: u64 = 1 << 63;

/// Whether a job is part of the canary battery.
#[must_use]
pub fn is_canary(job: JobId) -> bool {
    job.0 & CANARY_BIT != 0
}

/// What the battery found on one worker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CanaryReport {
    /// Checks that passed.
    pub passed: Vec<&'static str>,
    /// Checks that failed, with why.
    pub failed: Vec<(&'static str, String)>,
    /// Checks not run because their tensor is over this parent's import limit (it would
    /// take another rung).
    pub skipped: Vec<&'static str>,
}

impl CanaryReport {
    /// Whether every check passed.
    #[must_use]
    pub fn ok(&self) -> bool {
        self.failed.is_empty()
    }
}

impl std::fmt::Display for CanaryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} canaries passed",
            self.passed.len(),
            self.passed.len() + self.failed.len()
        )?;
        if !self.skipped.is_empty() {
            write!(f, " ({} over the import limit skipped)", self.skipped.len())?;
        }
        for (name, why) in &self.failed {
            write!(f, "; {name}: {why}")?;
        }
        Ok(())
    }
}

const MIB: u64 = 1 << 20;

/// One input of a canary: an allocation of `alloc` bytes filled with `pattern`, the tensor at
/// `offset` in it.
struct Piece {
    alloc: u64,
    offset: u64,
    desc: TensorDesc,
    pattern: u32,
}

fn piece(alloc: u64, offset: u64, dtype: DType, shape: &[u64], pattern: u32) -> Piece {
    Piece {
        alloc,
        offset,
        desc: TensorDesc::contiguous(dtype, shape),
        pattern,
    }
}

struct Battery<'p> {
    parent: &'p Parent,
    worker: poolipc_contract::WorkerId,
    stream: StreamHandle,
    next: u64,
    report: CanaryReport,
    /// The worker died (or was killed) during the battery: nothing more to prove.
    lost: bool,
}

impl Battery<'_> {
    /// Runs one canary job over `pieces` (a piece with `alloc == 0` reuses the previous
    /// allocation at its own offset) and records the outcome under `name`.
    fn check(&mut self, name: &'static str, pieces: &[Piece]) {
        if self.lost {
            return;
        }
        if pieces
            .iter()
            .any(|p| !self.parent.import_limit().allows(0, p.alloc))
        {
            self.report.skipped.push(name);
            return;
        }
        let outcome = self.run(pieces);
        match outcome {
            Ok(()) => self.report.passed.push(name),
            Err(why) => {
                tracing::warn!(canary = name, %why, "canary failed");
                self.report.failed.push((name, why));
            }
        }
    }

    fn run(&mut self, pieces: &[Piece]) -> Result<(), String> {
        let d = std::sync::Arc::clone(self.parent.driver());
        let s = self.stream;
        let mut allocs: Vec<DevicePtr> = Vec::new();
        let mut inputs = Vec::new();
        let e = |e: Error| e.to_string();
        for p in pieces {
            let base = if p.alloc == 0 {
                *allocs
                    .last()
                    .ok_or("a shared piece with no allocation before it")?
            } else {
                let a = self
                    .parent
                    .pool()
                    .alloc(p.alloc, s)
                    .map_err(|e| e.to_string())?;
                echo::fill_pattern(&*d, a, p.alloc, p.pattern, s).map_err(|e| e.to_string())?;
                allocs.push(a);
                a
            };
            inputs.push(Input {
                ptr: base.offset(p.offset),
                desc: p.desc.clone(),
                read_only: false,
            });
        }
        let job = JobId(CANARY_BIT | self.next);
        self.next += 1;
        let result = self
            .parent
            .submit_as(self.worker, job, &inputs, s, None)
            .and_then(crate::parent::JobHandle::wait);
        if let Err(Error::JobFailed { .. } | Error::UnknownWorker(_)) = &result {
            self.lost = true;
        }
        let outcome = (|| -> Result<(), String> {
            let out = result.map_err(e)?;
            d.stream_synchronize(s).map_err(|e| e.to_string())?;
            if out.results.len() != pieces.len() {
                return Err(format!(
                    "{} results for {} inputs",
                    out.results.len(),
                    pieces.len()
                ));
            }
            for (i, (p, r)) in pieces.iter().zip(&out.results).enumerate() {
                let check = echo::verify_echo(
                    &**self.parent.driver(),
                    r.ptr,
                    r.bytes,
                    i,
                    p.pattern,
                    p.offset,
                );
                // Arena results go back when `out` is dropped; pool results are freed here.
                if !r.is_arena() {
                    let _ = self.parent.pool().free(r.ptr, s);
                }
                check?;
            }
            Ok(())
        })();
        for a in allocs {
            let _ = self.parent.pool().free(a, s);
        }
        let _ = d.stream_synchronize(s);
        outcome
    }
}

/// Runs the battery on `worker`.
pub fn run(parent: &Parent, worker: poolipc_contract::WorkerId) -> Result<CanaryReport, Error> {
    // The battery allocates and checks on this thread: the device must be current here.
    parent.driver().use_device(parent.options().device)?;
    let stream = poolipc_driver::OwnedStream::new(std::sync::Arc::clone(parent.driver()))?;
    let mut b = Battery {
        parent,
        worker,
        stream: stream.handle(),
        next: 1,
        report: CanaryReport::default(),
        lost: false,
    };
    b.check(
        "import of a small tensor",
        &[piece(4096, 0, DType::F32, &[1024], 0x3F80_0000)],
    );
    b.check(
        "a view at an offset",
        &[piece(3 * MIB, MIB + 8, DType::I64, &[1000], 7)],
    );
    b.check(
        "a bf16 tensor of odd size",
        &[piece(24_690, 0, DType::BF16, &[12_345], 0x3F80_3F80)],
    );
    b.check(
        "a tensor over 2 MiB",
        &[piece(8 * MIB, 0, DType::F32, &[2 * MIB], 0x4000_0000)],
    );
    b.check(
        "a tensor spanning several 32 MiB chunks (events gate both ways)",
        &[piece(80 * MIB, 0, DType::U8, &[80 * MIB], 0x5A5A_5A5A)],
    );
    b.check(
        "import dedupe: one allocation lent twice in a job",
        &[
            piece(2 * MIB, 0, DType::U8, &[MIB], 0x0102_0304),
            Piece {
                alloc: 0,
                offset: MIB,
                desc: TensorDesc::contiguous(DType::U8, &[MIB]),
                pattern: 0x0102_0304,
            },
        ],
    );
    // The previous job's allocations were freed after the ACK; the pool hands the memory out
    // again with a new pattern, and the worker must see the new bytes.
    b.check(
        "unimport before reuse: recycled memory lent again",
        &[piece(2 * MIB, 0, DType::U8, &[MIB], 0x0A0B_0C0D)],
    );
    if b.lost {
        return Err(Error::Protocol(format!(
            "{worker} was lost during its canary battery: {}",
            b.report
        )));
    }
    let report = std::mem::take(&mut b.report);
    drop(stream);
    if report.ok() {
        tracing::info!(worker = %worker, "{report}");
    } else {
        tracing::warn!(worker = %worker, "{report}; the worker is demoted from the pool-pointer rung");
    }
    Ok(report)
}
