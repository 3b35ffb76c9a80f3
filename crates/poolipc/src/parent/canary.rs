//! The canary battery: before a worker takes jobs, the parent proves the whole contract on it
//! with real transfers, and demotes the worker to the next rung if anything fails.
//!
//! The worker side answers canary jobs inside [`Worker::next_job`](crate::Worker::next_job)
//! with the echo worker's behaviour, so user code never sees them.
//!
//! # The export reuse check
//!
//! Last in the battery, once per pool (the first worker whose battery passes makes it; see
//! [`check_export_reuse`]): whether a new allocation at a recycled address, of the same size,
//! may be lent with the blob exported for the earlier one, saving `cuMemPoolExportPointer`
//! (0.35–0.43 ms/GiB). Driver 580 allows it (docs/facts.md, `reuse_blob.py`), undocumented, so
//! it is proven here with a real worker: allocation A (64 MiB, two 32 MiB chunks) is lent
//! (exported, cached) and freed; the pool is asked for the same size until it hands A's
//! address back (at most [`REUSE_CHECK_TRIES`] allocations, else "not proven"); that
//! allocation B is filled with a new pattern and lent with A's blob on trial
//! ([`poolipc_pool::ReuseCheck`]); the worker must read B's bytes (its echo) and its write in
//! place must reach B. Anything else, the import refused included (the worker fails that job,
//! not itself), leaves reuse not proven: every allocation is exported, as before, and the log
//! and [`CanaryReport::export_reuse`] say why.

use poolipc_driver::{DevicePtr, Driver, StreamHandle};
use poolipc_pool::{ExportReuse, ReuseCheck};
use poolipc_transport::{DType, JobId};

use super::{Input, JobOutput, Parent};
use crate::canary::{
    CANARY_BIT, CANARY_IN_PLACE_BIT, CanaryReport, MIB, REUSE_CHECK_BYTES, REUSE_CHECK_TRIES,
    fill_pattern, marker, verify_echo,
};
use crate::error::Error;
use crate::tensor::Layout;

/// One input of a canary: an allocation of `alloc` bytes filled with `pattern`, the tensor at
/// `offset` in it.
struct Piece {
    alloc: u64,
    offset: u64,
    desc: Layout,
    pattern: u32,
}

fn piece(alloc: u64, offset: u64, dtype: DType, shape: &[u64], pattern: u32) -> Piece {
    Piece {
        alloc,
        offset,
        desc: Layout::contiguous(dtype, shape),
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
        let d = std::sync::Arc::clone(self.parent.driver_ref());
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
                fill_pattern(&*d, a, p.alloc, p.pattern, s).map_err(|e| e.to_string())?;
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
        let outcome =
            (|| -> Result<(), String> {
                let out = result.map_err(e)?;
                let verdict =
                    d.stream_synchronize(s)
                        .map_err(|e| e.to_string())
                        .and_then(|()| {
                            if out.results.len() != pieces.len() {
                                return Err(format!(
                                    "{} results for {} inputs",
                                    out.results.len(),
                                    pieces.len()
                                ));
                            }
                            pieces.iter().zip(&out.results).enumerate().try_for_each(
                                |(i, (p, r))| {
                                    verify_echo(&*d, r.ptr, r.bytes, i, p.pattern, p.offset)
                                },
                            )
                        });
                // Every result back, whatever the verdict (a worker that returns more results
                // than asked, or wrong bytes, must not leave pool memory behind): arena results
                // go back when `out` is dropped, pool results are freed here.
                for r in out.results.iter().filter(|r| !r.is_arena()) {
                    let _ = self.parent.pool().free(r.ptr, s);
                }
                verdict
            })();
        for a in allocs {
            let _ = self.parent.pool().free(a, s);
        }
        let _ = d.stream_synchronize(s);
        outcome
    }
}

/// What one try of the export reuse check came to.
enum Trial {
    Proven,
    NotProven(String),
    /// Nothing was learnt of the driver (the worker failed or was lost, setup failed): a
    /// later battery may try again.
    Inconclusive(String),
}

/// The first pattern word of the check's allocations, before and after the address is
/// recycled.
const BEFORE: u32 = 0x1111_1111;
const AFTER: u32 = 0x2222_2222;

impl Battery<'_> {
    /// One canary job over `inputs`, its output once this battery's stream (which waited on
    /// the job's DONE) is synchronized. Results held by `out` must be given back with
    /// [`give_back`](Battery::give_back).
    fn job(&mut self, inputs: &[Input], in_place: bool) -> Result<JobOutput, Error> {
        let mut id = CANARY_BIT | self.next;
        if in_place {
            id |= CANARY_IN_PLACE_BIT;
        }
        self.next += 1;
        let result = self
            .parent
            .submit_as(self.worker, JobId(id), inputs, self.stream, None)
            .and_then(crate::parent::JobHandle::wait);
        if let Err(Error::JobFailed { .. } | Error::UnknownWorker(_)) = &result {
            self.lost = true;
        }
        let out = result?;
        self.parent.driver_ref().stream_synchronize(self.stream)?;
        Ok(out)
    }

    /// Frees a job's pool results (arena results go back when `out` drops).
    fn give_back(&self, out: JobOutput) {
        for r in &out.results {
            if !r.is_arena() {
                let _ = self.parent.pool().free(r.ptr, self.stream);
            }
        }
    }

    /// Checks the echo of `out`'s first result against `pattern`, then gives `out` back.
    fn echoed(&self, out: JobOutput, pattern: u32) -> Result<(), String> {
        let check = match out.results.first() {
            Some(r) => verify_echo(&**self.parent.driver_ref(), r.ptr, r.bytes, 0, pattern, 0),
            None => Err("the job gave no result".into()),
        };
        self.give_back(out);
        check
    }

    /// Runs the export reuse check on the parent's first pool, unless a battery made it
    /// already (or makes it now), or this worker failed a canary (it proves nothing).
    fn check_export_reuse(&mut self) {
        if self.lost || !self.report.ok() {
            return;
        }
        let parent = self.parent;
        let Some(check) = parent.pool().begin_export_reuse_check() else {
            return;
        };
        let mut held = Vec::new();
        let trial = self.reuse_trial(&check, &mut held);
        // The verdict first, which ends the trial: once the check's allocation is freed,
        // another thread's allocation may take its address, and must not be lent with the
        // old blob on trial.
        match trial {
            Trial::Proven => check.finish(Ok(())),
            Trial::NotProven(why) => check.finish(Err(why)),
            Trial::Inconclusive(why) => {
                tracing::info!(worker = %self.worker, %why, "poolipc: the export reuse check \
                    learnt nothing; a later worker's battery makes it again");
                drop(check);
            }
        }
        for p in held {
            let _ = parent.pool().free(p, self.stream);
        }
        let _ = parent.driver_ref().stream_synchronize(self.stream);
    }

    /// The check's steps (see the module docs); what it allocates goes into `held`, for
    /// the caller to free whatever the outcome.
    fn reuse_trial(
        &mut self,
        check: &ReuseCheck<'_, dyn Driver>,
        held: &mut Vec<DevicePtr>,
    ) -> Trial {
        let (parent, s, bytes) = (self.parent, self.stream, REUSE_CHECK_BYTES);
        let (d, pool) = (std::sync::Arc::clone(parent.driver_ref()), parent.pool());
        if !parent.import_limit().allows(0, bytes) {
            return Trial::Inconclusive(format!("{bytes} bytes are over the import limit"));
        }
        let input = |ptr| Input {
            ptr,
            desc: Layout::contiguous(DType::U8, &[bytes]),
            read_only: false,
        };
        let setup = |e: &dyn std::fmt::Display| Trial::Inconclusive(format!("setup: {e}"));
        // A: lent the ordinary way, so its blob is exported and cached.
        let a = match pool.alloc(bytes, s) {
            Ok(a) => a,
            Err(e) => return setup(&e),
        };
        held.push(a);
        // The size as the lend path reads it (one `cuPointerGetAttributes`).
        let size = match d.pointer_info(a) {
            Ok(info) => info.size,
            Err(e) => return setup(&e),
        };
        if let Err(e) = fill_pattern(&*d, a, bytes, BEFORE, s) {
            return setup(&e);
        }
        match self.job(&[input(a)], false) {
            Ok(out) => {
                if let Err(why) = self.echoed(out, BEFORE) {
                    return Trial::Inconclusive(format!("the first allocation's echo: {why}"));
                }
            }
            Err(e) => return Trial::Inconclusive(format!("lending the first allocation: {e}")),
        }
        // Freed after the job (its DONE waited on by this stream), as torch frees: the
        // cache is not told, so A's entry stays.
        held.retain(|&p| p != a);
        // Waited for, so that the pool may hand the memory out on any stream.
        if let Err(e) = poolipc_driver::PoolAllocation::claim(&*d, a)
            .and_then(|a| a.free(s))
            .and_then(|()| d.stream_synchronize(s))
        {
            return setup(&e);
        }
        // B: the same size until the pool hands A's address back, each miss held.
        let mut b = None;
        for _ in 0..REUSE_CHECK_TRIES {
            match pool.alloc(bytes, s) {
                Ok(p) => {
                    held.push(p);
                    if p == a {
                        b = Some(p);
                        break;
                    }
                }
                Err(e) => return setup(&e),
            }
        }
        let Some(b) = b else {
            return Trial::NotProven(format!(
                "the pool did not hand a freed address back in {REUSE_CHECK_TRIES} allocations \
                 of the same size: nothing to prove reuse on"
            ));
        };
        match d.pointer_info(b) {
            Ok(info) if info.size == size => {}
            Ok(info) => {
                return Trial::NotProven(format!(
                    "the new allocation at the address reports {} bytes, the old {size}",
                    info.size
                ));
            }
            Err(e) => return setup(&e),
        }
        // Only now, with B (ours) at the address, may the address reuse its blob on trial.
        check.trial(b, size);
        if let Err(e) = fill_pattern(&*d, b, bytes, AFTER, s) {
            return setup(&e);
        }
        // Lent with A's blob: never exported since B was allocated.
        let out = match self.job(&[input(b)], true) {
            Ok(out) => out,
            // Lost here, most likely to the old blob: not proven, for good, so that no later
            // worker is lost to the same check.
            Err(e) if self.lost => {
                return Trial::NotProven(format!(
                    "the worker was lost in the job lending the new allocation with the old \
                     blob: {e}"
                ));
            }
            Err(e) => {
                return Trial::NotProven(format!(
                    "the job lending the new allocation with the old blob failed: {e}"
                ));
            }
        };
        if !check.trial_used() {
            self.give_back(out);
            return Trial::NotProven(
                "the export cache did not hold the old blob (is it off?): nothing was tried".into(),
            );
        }
        if let Err(why) = self.echoed(out, AFTER) {
            return Trial::NotProven(format!(
                "through the old blob the worker did not read the new allocation's bytes: {why}"
            ));
        }
        let mut word = [0u8; 4];
        if let Err(e) = d.memcpy_dtoh(&mut word, b) {
            return setup(&e);
        }
        if word != marker(0).to_le_bytes() {
            return Trial::NotProven(format!(
                "the worker's write through the old blob did not reach the new allocation \
                 (its first word is {:#010x})",
                u32::from_le_bytes(word)
            ));
        }
        Trial::Proven
    }
}

/// Runs the export reuse check with `worker` if the parent's pool has no verdict yet (see
/// the module docs), and returns the pool's verdict. For a parent that runs no canary
/// battery (`ParentOptions::canary` off), which otherwise keeps exporting every allocation.
pub(crate) fn check_export_reuse(
    parent: &Parent,
    worker: poolipc_contract::WorkerId,
) -> Result<(ExportReuse, Option<String>), Error> {
    parent.driver_ref().use_device(parent.options().device)?;
    let stream = poolipc_driver::OwnedStream::new(std::sync::Arc::clone(parent.driver_ref()))?;
    let mut b = Battery {
        parent,
        worker,
        stream: stream.handle(),
        next: 1 << 40,
        report: CanaryReport::default(),
        lost: false,
    };
    b.check_export_reuse();
    if b.lost {
        return Err(Error::Protocol(format!(
            "{worker} was lost during the export reuse check"
        )));
    }
    drop(stream);
    Ok(parent.pool().export_reuse())
}

/// Runs the battery on `worker`.
pub(crate) fn run(
    parent: &Parent,
    worker: poolipc_contract::WorkerId,
) -> Result<CanaryReport, Error> {
    // The battery allocates and checks on this thread: the device must be current here.
    parent.driver_ref().use_device(parent.options().device)?;
    let stream = poolipc_driver::OwnedStream::new(std::sync::Arc::clone(parent.driver_ref()))?;
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
                desc: Layout::contiguous(DType::U8, &[MIB]),
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
    b.check_export_reuse();
    b.report.export_reuse = parent.pool().export_reuse();
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
